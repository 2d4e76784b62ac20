// int4 weights times int8 activations: llama.cpp's arithmetic on AVX-512 VNNI and AVX2.
#include "common.h"

#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define AVX2 __attribute__((target("avx2,fma")))

// Every 32 activations of a row to int8 levels with their own step d (the group's largest |x| / 127);
// s = d * the sum of the group's levels, which the weights' offsets multiply.
static void quantize_rows(const void* x, int bf16, int M, int K, int8_t* xq, float* d, float* s) {
  int G = K / 32;
  for (int r = 0; r < M; r++)
    for (int g = 0; g < G; g++) {
      long at = (long)r * K + g * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(value(x, bf16, at + i)));
      float inv = amax > 0 ? 127.f / amax : 0.f;
      int sum = 0;
      for (int i = 0; i < 32; i++) {
        int q = (int)nearbyintf(value(x, bf16, at + i) * inv);  // to nearest, ties to even
        q = q > 127 ? 127 : q < -127 ? -127 : q;
        xq[at + i] = (int8_t)q;
        sum += q;
      }
      d[r * G + g] = amax / 127.f;
      s[r * G + g] = amax / 127.f * (float)sum;
    }
}

// ---- AVX-512 VNNI: 16 channels a vector.
// R rows (at most 4) against one block of 16 output channels, accumulated in acc[R] (16 floats each).
// Per group of 32 inputs: four 64-byte loads of levels, each 16 channels x 8 inputs (low nibbles: inputs
// 0-3, high: 4-7); vpdpbusd multiplies 64 unsigned levels by 4 int8 activations broadcast to every channel
// and adds each channel's four products into its int32 lane. Then, in float:
// y += d * scale * dot + s * offset.
AVX512 INLINE void rows_vnni(const uint8_t* w, const uint16_t* sm, const int8_t* xq, const float* d,
                             const float* s, int R, int K, __m512* acc) {
  int G = K / 32;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int g = 0; g < G; g++) {
    __m512i dot[4];
    for (int r = 0; r < R; r++) dot[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
      _mm_prefetch((const char*)w + (g * 4 + c) * 64 + 4096, _MM_HINT_T0);  // 4 KB ahead: 25% faster
      __m512i v = _mm512_loadu_si512(w + (g * 4 + c) * 64);
      __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int r = 0; r < R; r++) {
        const int32_t* xk = (const int32_t*)(xq + (long)r * K + g * 32 + c * 8);
        dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(xk[0]));
        dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(xk[1]));
      }
    }
    _mm_prefetch((const char*)(sm + g * 32) + 1024, _MM_HINT_T0);
    __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(sm + g * 32)));
    __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));  // bfloat16 to float32: a shift
    bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(sm + g * 32 + 16)));
    __m512 offset = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    for (int r = 0; r < R; r++) {
      __m512 ds = _mm512_mul_ps(scale, _mm512_set1_ps(d[r * G + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), ds, acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(s[r * G + g]), acc[r]);
    }
  }
}

AVX512 static void tile_vnni(const uint8_t* w, const uint16_t* sm, const int8_t* xq, const float* d,
                             const float* s, int R, int K, float* out) {  // out: R x 16 floats
  __m512 acc[4] = {0};
  switch (R) {  // R a constant in each call: the row loops unroll
    case 1: rows_vnni(w, sm, xq, d, s, 1, K, acc); break;
    case 2: rows_vnni(w, sm, xq, d, s, 2, K, acc); break;
    case 3: rows_vnni(w, sm, xq, d, s, 3, K, acc); break;
    default: rows_vnni(w, sm, xq, d, s, 4, K, acc);
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

// ---- AVX2: the same layout, 8 channels a vector. vpmaddubsw multiplies 32 unsigned levels by 32 int8
// activations and adds pairs into 16-bit lanes (at most 2 * 15 * 127 each, 8 of them a group: no overflow);
// vpmaddwd by ones then adds the pairs of those into each channel's int32 lane.
AVX2 INLINE void rows_avx2(const uint8_t* w, const uint16_t* sm, const int8_t* xq, const float* d,
                           const float* s, int R, int K, __m256* acc) {
  int G = K / 32;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int i = 0; i < 2 * R; i++) acc[i] = _mm256_setzero_ps();
  for (int g = 0; g < G; g++) {
    __m256i sum[8];  // [row][half of the 16 channels], 16-bit
    for (int i = 0; i < 2 * R; i++) sum[i] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
      _mm_prefetch((const char*)w + (g * 4 + c) * 64 + 4096, _MM_HINT_T0);
      for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(w + (g * 4 + c) * 64 + h * 32));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; r++) {
          const int32_t* xk = (const int32_t*)(xq + (long)r * K + g * 32 + c * 8);
          __m256i p = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xk[0]));
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xk[1])));
          sum[r * 2 + h] = _mm256_add_epi16(sum[r * 2 + h], p);
        }
      }
    }
    for (int h = 0; h < 2; h++) {
      __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(sm + g * 32 + h * 8)));
      __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
      bits = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(sm + g * 32 + 16 + h * 8)));
      __m256 offset = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
      for (int r = 0; r < R; r++) {
        __m256i dot = _mm256_madd_epi16(sum[r * 2 + h], ones);
        __m256 ds = _mm256_mul_ps(scale, _mm256_set1_ps(d[r * G + g]));
        acc[r * 2 + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ds, acc[r * 2 + h]);
        acc[r * 2 + h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(s[r * G + g]), acc[r * 2 + h]);
      }
    }
  }
}

AVX2 static void tile_avx2(const uint8_t* w, const uint16_t* sm, const int8_t* xq, const float* d,
                           const float* s, int R, int K, float* out) {  // out: R x 16 floats
  __m256 acc[8] = {0};
  switch (R) {
    case 1: rows_avx2(w, sm, xq, d, s, 1, K, acc); break;
    case 2: rows_avx2(w, sm, xq, d, s, 2, K, acc); break;
    case 3: rows_avx2(w, sm, xq, d, s, 3, K, acc); break;
    default: rows_avx2(w, sm, xq, d, s, 4, K, acc);
  }
  for (int i = 0; i < 2 * R; i++) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

typedef void (*tile_fn)(const uint8_t*, const uint16_t*, const int8_t*, const float*, const float*, int, int,
                        float*);

// All M rows against the block of 16 channels at `nb`, four rows at a time, into y (plus the bias).
static void block(tile_fn tile, const uint8_t* w, const uint16_t* sm, const int8_t* xq, const float* d,
                  const float* s, const float* bias, int M, int K, int N, int nb, int bf16, void* y) {
  int G = K / 32;
  for (int r0 = 0; r0 < M; r0 += 4) {
    float out[64];
    int R = M - r0 < 4 ? M - r0 : 4;
    tile(w, sm, xq + (long)r0 * K, d + r0 * G, s + r0 * G, R, K, out);
    for (int r = 0; r < R; r++)
      for (int j = 0; j < 16; j++)
        put(y, bf16, (long)(r0 + r) * N + nb * 16 + j, out[16 * r + j] + (bias ? bias[nb * 16 + j] : 0.f));
  }
}

// y [M, N] = x [M, K] W^T + bias, in the instructions `isa` names (0: AVX-512 VNNI, 1: AVX2). W: int4 levels
// `w` [N/16][K/8][16][4] bytes (two levels a byte) and bfloat16 `sm` [N/16][K/32][2][16] (each group's
// scale, then its offset: a weight is level * scale + offset). x and y float32 or bfloat16 (`bf16`), bias
// float32 or NULL. Returns 0, or -1 where memory ran out.
int int4_linear(int isa, const void* x, int bf16, int M, int K, const uint8_t* w, const uint16_t* sm,
                const float* bias, int N, void* y, int threads) {
  int G = K / 32, NB = N / 16;
  int8_t* xq = malloc((size_t)M * K + 1);
  float* d = malloc(sizeof(float) * ((size_t)M * G * 2 + 1));
  if (!xq || !d) { free(xq); free(d); return -1; }
  float* s = d + (size_t)M * G;
  quantize_rows(x, bf16, M, K, xq, d, s);
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int nb = 0; nb < NB; nb++) {
    const uint8_t* wp = w + (long)nb * (K / 8) * 64;
    const uint16_t* sp = sm + (long)nb * G * 32;
    block(isa == 0 ? tile_vnni : tile_avx2, wp, sp, xq, d, s, bias, M, K, N, nb, bf16, y);
  }
  free(xq);
  free(d);
  return 0;
}

// 0 where `isa`'s kernel agrees with plain C on a small product: run once, in a child process, before first
// use (a CPU that lists the flags but faults on the instructions kills the child, not the server).
int int4_selftest(int isa) {
  enum { M = 5, K = 64, N = 32, G = K / 32 };
  static uint8_t w[N / 16 * K / 8 * 64];
  static uint16_t sm[N / 16 * G * 32];
  static float x[M * K], y[M * N], bias[N];
  memset(w, 0, sizeof w);
  for (int n = 0; n < N; n++) {
    bias[n] = n / 8.f;
    for (int g = 0; g < G; g++) {  // scales and offsets that bfloat16 holds exactly
      float sc = (1 + (n + g) % 5) / 64.f, off = -((n * g) % 3) / 8.f;
      uint32_t a, b;
      memcpy(&a, &sc, 4);
      memcpy(&b, &off, 4);
      sm[((n / 16) * G + g) * 32 + n % 16] = a >> 16;
      sm[((n / 16) * G + g) * 32 + 16 + n % 16] = b >> 16;
    }
    for (int k = 0; k < K; k++) {
      uint8_t q = (n * 7 + k * 3) % 16;
      uint8_t* at = w + (((n / 16) * (K / 8) + k / 8) * 16 + n % 16) * 4 + k % 4;
      *at |= k % 8 < 4 ? q : q << 4;
    }
  }
  for (int i = 0; i < M * K; i++) x[i] = ((i * 5) % 17 - 8) / 4.f;  // |x| <= 2
  if (int4_linear(isa, x, 0, M, K, w, sm, bias, N, y, 1)) return 2;
  for (int r = 0; r < M; r++)
    for (int n = 0; n < N; n++) {
      double want = bias[n], bound = 1e-3;
      for (int k = 0; k < K; k++) {
        int g = k / 32;
        double sc = (1 + (n + g) % 5) / 64., off = -((n * g) % 3) / 8.;
        double wt = ((n * 7 + k * 3) % 16) * sc + off;
        want += wt * x[r * K + k];
        bound += fabs(wt) * 2. / 127;  // int8 activations: each off by at most half a step of 2 / 127
      }
      if (fabs(y[r * N + n] - want) > bound) return 1;
    }
  return 0;
}
