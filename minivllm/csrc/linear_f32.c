// float32 products in a register tile, on AVX-512 and AVX2.
#include "common.h"

#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma")))

// ---- AVX-512: R rows (at most 6) by C blocks of 16 channels (at most 4) in R * C registers.
// W: [N/16][K][16], bs = K * 16 floats from one block to the next.
// Per input k: C loads, R broadcasts, R * C multiply-adds.
AVX512 INLINE void rows_f32_512(const float* w, long bs, const float* x, int K, int R, int C, const float* b,
                                float* y, int N) {
  __m512 acc[6][4];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) acc[r][c] = b ? _mm512_loadu_ps(b + c * 16) : _mm512_setzero_ps();
  for (int k = 0; k < K; k++) {
    __m512 wv[4];
    for (int c = 0; c < C; c++) wv[c] = _mm512_loadu_ps(w + c * bs + (long)k * 16);
    for (int r = 0; r < R; r++) {
      __m512 xv = _mm512_set1_ps(x[(long)r * K + k]);
      for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) _mm512_storeu_ps(y + (long)r * N + c * 16, acc[r][c]);
}

// R a constant in each call: the loops over rows and blocks unroll and the accumulators stay in registers
#define F32_ROWS(f, C)                              \
  switch (R) {                                      \
    case 1: f(w, bs, x, K, 1, C, b, y, N); break;   \
    case 2: f(w, bs, x, K, 2, C, b, y, N); break;   \
    case 3: f(w, bs, x, K, 3, C, b, y, N); break;   \
    case 4: f(w, bs, x, K, 4, C, b, y, N); break;   \
    case 5: f(w, bs, x, K, 5, C, b, y, N); break;   \
    default: f(w, bs, x, K, 6, C, b, y, N);         \
  }

AVX512 static void tile_f32_512(const float* w, long bs, const float* x, int K, int R, int C, const float* b,
                                float* y, int N) {  // R rows by C blocks, into y (row stride N)
  if (C == 4) {
    F32_ROWS(rows_f32_512, 4)
    return;
  }
  for (int c = 0; c < C; c++, w += bs, y += 16, b = b ? b + 16 : 0) F32_ROWS(rows_f32_512, 1)
}

// ---- AVX2: 8 floats a register, so one block of 16 channels (two registers) by R rows at a time.
AVX2 INLINE void rows_f32_256(const float* w, long bs, const float* x, int K, int R, int C, const float* b,
                              float* y, int N) {
  (void)bs, (void)C;  // one block a call: F32_ROWS passes them as it does to the AVX-512 tile
  __m256 acc[6][2];
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++) acc[r][h] = b ? _mm256_loadu_ps(b + h * 8) : _mm256_setzero_ps();
  for (int k = 0; k < K; k++) {
    __m256 w0 = _mm256_loadu_ps(w + (long)k * 16), w1 = _mm256_loadu_ps(w + (long)k * 16 + 8);
    for (int r = 0; r < R; r++) {
      __m256 xv = _mm256_set1_ps(x[(long)r * K + k]);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + (long)r * N + h * 8, acc[r][h]);
}

AVX2 static void tile_f32_256(const float* w, long bs, const float* x, int K, int R, int C, const float* b,
                              float* y, int N) {
  for (int c = 0; c < C; c++, w += bs, y += 16, b = b ? b + 16 : 0) F32_ROWS(rows_f32_256, 1)
}

typedef void (*f32_tile_fn)(const float*, long, const float*, int, int, int, const float*, float*, int);

// y [M, N] = x [M, K] W^T + bias in float32, in the instructions `isa` names (0: AVX-512, 1: AVX2). W: `w`
// [N/16][K][16]; bias float32 or NULL. A thread takes a panel of 4 blocks (64 channels) and runs every 6 rows
// through it while it sits in the core's cache.
int f32_linear(int isa, const float* x, int M, int K, const float* w, const float* bias, int N, float* y,
               int threads) {
  int NB = N / 16, P = (NB + 3) / 4;
  long bs = (long)K * 16;
  f32_tile_fn tile = isa == 0 ? tile_f32_512 : tile_f32_256;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int p = 0; p < P; p++) {
    int C = NB - p * 4 < 4 ? NB - p * 4 : 4;
    for (int r0 = 0; r0 < M; r0 += 6)
      tile(w + p * 4 * bs, bs, x + (long)r0 * K, K, M - r0 < 6 ? M - r0 : 6, C, bias ? bias + p * 64 : 0,
           y + (long)r0 * N + p * 64, N);
  }
  return 0;
}

// 0 where `isa`'s kernel gives the exact sums of a small product: 8 rows (a tile and a part), 5 blocks
// (a panel and a lone block), numbers in 1/32 steps so that every partial sum is exact in float32.
int f32_selftest(int isa) {
  enum { M = 8, K = 24, N = 80 };
  static float w[N * K], x[M * K], y[M * N], bias[N];
  for (int n = 0; n < N; n++) {
    bias[n] = (n % 7) / 4.f;
    for (int k = 0; k < K; k++) w[((n / 16) * K + k) * 16 + n % 16] = ((n * 5 + k * 3) % 11 - 5) / 8.f;
  }
  for (int i = 0; i < M * K; i++) x[i] = ((i * 7) % 13 - 6) / 4.f;
  f32_linear(isa, x, M, K, w, bias, N, y, 2);
  for (int r = 0; r < M; r++)
    for (int n = 0; n < N; n++) {
      double want = bias[n];
      for (int k = 0; k < K; k++) want += ((n * 5 + k * 3) % 11 - 5) / 8. * x[r * K + k];
      if (y[r * N + n] != (float)want) return 1;
    }
  return 0;
}
