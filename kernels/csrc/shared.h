// What the AVX2 and AVX-512 kernels share: 256-bit helpers, the walk of a column over tiles of rows, and Q4_K_LANES'
// float steps. Internal linkage: each unit that includes this builds its own copy with its own instruction-set
// flags, so no unit calls another's build of them.
#pragma once
#include <immintrin.h>

#include <cstring>

#include "blocks.h"

namespace specchat {
namespace {

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The sum of a vector's 8 floats, in one fixed order.
inline float sum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// The weights stream from memory once: ask for the cache lines of the blocks `ahead` bytes on (0: 1 KB), which the
// hardware prefetcher alone brings too late while the dot products run.
inline void prefetch(const uint8_t* p, int64_t bytes, int64_t ahead) {
  if (ahead == 0) ahead = 1024;
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + ahead + line), _MM_HINT_T0);
}

// The packed activations of rows [row0, row0 + R): each row's first unit.
template <int R>
void packed_rows(const Activations& a, int64_t row0, const int8_t* (&rows)[R]) {
  for (int r = 0; r < R; ++r) rows[r] = a.packed + (row0 + r) * a.row_stride;
}

// Q4_K_LANES (lanes.h): weight = d * scale * code - dmin * min, a block's 8 groups on 8 float lanes. `step` adds a
// row's group sums (exact int32) to its accumulator: scale times the sum less min times the float sum of the group's
// values (stored after the unit's values), times the group's activation scale.
struct Q4KLaneScales {
  __m256 scale, min;
  explicit Q4KLaneScales(const uint8_t* block) {
    int32_t d_dmin;
    std::memcpy(&d_dmin, block + 144, 4);
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(d_dmin));
    scale = _mm256_mul_ps(_mm256_broadcastss_ps(d), bytes(block + 128));
    min = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(d)), bytes(block + 136));
  }
  static __m256 bytes(const uint8_t* p) {  // 8 unsigned bytes as floats
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  __m256 step(__m256 acc, __m256i sums, const int8_t* unit_terms) const {
    const float* groups = reinterpret_cast<const float*>(unit_terms);
    const __m256 value = _mm256_fnmadd_ps(_mm256_loadu_ps(groups + 8), min,
                                          _mm256_mul_ps(_mm256_cvtepi32_ps(sums), scale));
    return _mm256_fmadd_ps(value, _mm256_loadu_ps(groups), acc);
  }
};

using RowsKernel = void (*)(int64_t type, const uint8_t* w, const Activations& a, int64_t row0, float* result);

// Rows [m, end) of one output column, R at a time while R fit; the first row not taken.
template <int R, RowsKernel kRows>
int64_t tile(int64_t type, const uint8_t* weights, const Activations& a, int64_t m, int64_t end, float add, float* out,
             int64_t n_out, int64_t n) {
  float result[R];
  for (; m + R <= end; m += R) {
    kRows(type, weights, a, m, result);
    for (int r = 0; r < R; ++r) out[(m + r) * n_out + n] = result[r] + add;
  }
  return m;
}

}  // namespace
}  // namespace specchat
