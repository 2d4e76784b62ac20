// What every C source of mini-vLLM starts with: the headers, INLINE, and elements of float32 or bfloat16
// arrays read and written as float.
#ifndef MINIVLLM_COMMON_H
#define MINIVLLM_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float value(const void* x, int bf16, long i) {  // element i of a float32 or bfloat16 array
  if (!bf16) return ((const float*)x)[i];
  uint32_t u = (uint32_t)((const uint16_t*)x)[i] << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

INLINE void put(void* y, int bf16, long i, float f) {  // element i of a float32 or bfloat16 array
  if (!bf16) { ((float*)y)[i] = f; return; }
  uint32_t u;
  memcpy(&u, &f, 4);
  ((uint16_t*)y)[i] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);  // to nearest, ties to even
}

#endif  // MINIVLLM_COMMON_H
