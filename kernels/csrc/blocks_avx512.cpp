// AVX-512 (F, BW, DQ, VL) + VNNI kernels. The weights of a unit (256 for the K-quants, four blocks = 128 for Q4_0,
// Q5_0 and Q8_0) come as 64-byte vectors whose int32 lanes each belong to one scale group (packed so at load,
// lanes.h), and the activations are stored in the matching order when they are rounded: `vpdpbusd` then sums a
// lane's products over the whole unit in int32, and a row pays one conversion and two float steps per unit instead
// of one per group.
// Every row runs the same instructions in the same order whatever the number of rows and the thread: a row's result
// has the same bits in a verify as in a one-token step.
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "blocks.h"
#include "lanes.h"
#include "shared.h"

namespace specchat {
namespace avx512 {
namespace {

inline __m512i load(const void* p) { return _mm512_loadu_si512(p); }

// Per row: per 32 values one scale (max |x| / 127) and int8 values, then packed as the kernels read them
// (pack_activations).
void quantize(int64_t type, const float* x, int64_t row0, int64_t rows, const Activations& a) {
  const int64_t groups = a.k / 32;
  std::vector<int8_t> natural(static_cast<size_t>(a.k));
  std::vector<float> scale(static_cast<size_t>(groups));
  for (int64_t m = row0; m < row0 + rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xs = x + m * a.k + g * 32;
      const __m512 low = _mm512_loadu_ps(xs), high = _mm512_loadu_ps(xs + 16);
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
      scale[g] = top / 127.0f;
      const __m512 inverse = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
      const __m512i limit = _mm512_set1_epi32(127), floor = _mm512_set1_epi32(-127);
      for (int h = 0; h < 2; ++h) {
        __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_ps(h ? high : low, inverse),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_max_epi32(_mm512_min_epi32(v, limit), floor);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(natural.data() + g * 32 + 16 * h), _mm512_cvtepi32_epi8(v));
      }
    }
    pack_activations(type, natural.data(), scale.data(), const_cast<int8_t*>(a.packed) + m * a.row_stride, a.k);
  }
}

// Q4_K_LANES (lanes.h): weight = d * scale * code - dmin * min. Lanes g and g + 8 are group g: their int32 sums are
// added, and the float steps run on the 8 groups.
template <int R>
void q4_k(const uint8_t* w, const Activations& a, int64_t row0, float* result) {
  const int64_t units = a.k / 256;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* rows[R];
  packed_rows<R>(a, row0, rows);
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* block = w + u * 148;
    prefetch(block, 148, a.ahead);
    const Q4KLaneScales scales(block);
    const __m512i first = load(block), second = load(block + 64);
    const __m512i codes[4] = {_mm512_and_si512(first, nibble), _mm512_and_si512(_mm512_srli_epi16(first, 4), nibble),
                              _mm512_and_si512(second, nibble), _mm512_and_si512(_mm512_srli_epi16(second, 4), nibble)};
    const int64_t at = u * (256 + kUnitExtra);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[0], load(rows[r] + at));
    for (int t = 1; t < 4; ++t)
      for (int r = 0; r < R; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], codes[t], load(rows[r] + at + 64 * t));
    for (int r = 0; r < R; ++r) {  // lanes g and g + 8 added: group g
      const __m256i sums = _mm256_add_epi32(_mm512_castsi512_si256(dot[r]), _mm512_extracti64x4_epi64(dot[r], 1));
      acc[r] = scales.step(acc[r], sums, rows[r] + at + 256);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = sum8(acc[r]);
}

// Q6_K_LANES (lanes.h): weight = d * scale * (code - 32). Lane 4m + i is sub-block 4i + m.
template <int R>
void q6_k(const uint8_t* w, const Activations& a, int64_t row0, float* result) {
  const int64_t units = a.k / 256;
  const __m512i nibble = _mm512_set1_epi8(0x0F), high_pair = _mm512_set1_epi8(0x30);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* rows[R];
  packed_rows<R>(a, row0, rows);
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* block = w + u * 210;
    prefetch(block, 210, a.ahead);
    const __m128i scale_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    const __m512 scales = _mm512_mul_ps(_mm512_set1_ps(half(block + 208)),
                                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scale_bytes)));
    const __m512i first = load(block), second = load(block + 64), high = load(block + 128);
    const __m512i codes[4] = {
        _mm512_or_si512(_mm512_and_si512(first, nibble), _mm512_and_si512(_mm512_slli_epi16(high, 4), high_pair)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(first, 4), nibble),
                        _mm512_and_si512(_mm512_slli_epi16(high, 2), high_pair)),
        _mm512_or_si512(_mm512_and_si512(second, nibble), _mm512_and_si512(high, high_pair)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(second, 4), nibble),
                        _mm512_and_si512(_mm512_srli_epi16(high, 2), high_pair))};
    const int64_t at = u * (256 + kUnitExtra);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = load(rows[r] + at + 256 + 64);
    for (int t = 0; t < 4; ++t)
      for (int r = 0; r < R; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], codes[t], load(rows[r] + at + 64 * t));
    for (int r = 0; r < R; ++r) {
      const __m512 lanes = _mm512_loadu_ps(reinterpret_cast<const float*>(rows[r] + at + 256));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), scales), lanes, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = _mm512_reduce_add_ps(acc[r]);
}

// Q4_0_LANES, Q5_0_LANES and Q8_0_LANES (lanes.h): weight = d * (code - 8), d * (code - 16) and d * (code - 128) for
// the unsigned codes; lanes 4m..4m + 3 are block m.
template <int R, int64_t kType>
void small_blocks(const uint8_t* w, const Activations& a, int64_t row0, float* result) {
  constexpr bool kQ8 = kType == Q8_0;
  constexpr int64_t bytes = kQ8 ? 136 : kType == Q5_0 ? 88 : 72;
  const int64_t units = a.k / 128;
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i nibble = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* rows[R];
  packed_rows<R>(a, row0, rows);
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = w + u * bytes;
    prefetch(unit, bytes, a.ahead);
    __m512i codes[2];
    if (kQ8) {
      codes[0] = load(unit);
      codes[1] = load(unit + 64);
    } else if (kType == Q4_0) {
      const __m512i low = load(unit);
      codes[0] = _mm512_and_si512(low, nibble);
      codes[1] = _mm512_and_si512(_mm512_srli_epi16(low, 4), nibble);
    } else {
      uint64_t high[2];
      std::memcpy(high, unit + 64, 16);
      const __m512i low = load(unit);
      codes[0] = _mm512_or_si512(_mm512_and_si512(low, nibble), _mm512_maskz_mov_epi8(high[0], bit4));
      codes[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), nibble),
                                 _mm512_maskz_mov_epi8(high[1], bit4));
    }
    const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit + bytes - 8)));
    const __m512 scales = _mm512_permutexvar_ps(quarter, _mm512_castps128_ps512(d4));
    const int64_t at = u * (128 + kUnitExtra);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_dpbusd_epi32(load(rows[r] + at + 128 + 64), codes[0], load(rows[r] + at));
    for (int r = 0; r < R; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], codes[1], load(rows[r] + at + 64));
    for (int r = 0; r < R; ++r) {
      const __m512 lanes = _mm512_loadu_ps(reinterpret_cast<const float*>(rows[r] + at + 128));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), scales), lanes, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = _mm512_reduce_add_ps(acc[r]);
}

template <int R>
void rows(int64_t type, const uint8_t* w, const Activations& a, int64_t row0, float* result) {
  switch (type) {
    case Q4_K_LANES: q4_k<R>(w, a, row0, result); break;
    case Q6_K_LANES: q6_k<R>(w, a, row0, result); break;
    case Q8_0_LANES: small_blocks<R, Q8_0>(w, a, row0, result); break;
    case Q5_0_LANES: small_blocks<R, Q5_0>(w, a, row0, result); break;
    case Q4_0_LANES: small_blocks<R, Q4_0>(w, a, row0, result); break;
  }
}

void matmul(int64_t type, const uint8_t* w, int64_t row_bytes, const Activations& a, int64_t row0, int64_t count,
            const float* bias, float* out, int64_t n_out, int64_t n0, int64_t n1) {
  const int64_t end = row0 + count;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* weights = w + n * row_bytes;
    const float add = bias ? bias[n] : 0.0f;
    int64_t m = tile<8, rows<8>>(type, weights, a, row0, end, add, out, n_out, n);
    m = tile<4, rows<4>>(type, weights, a, m, end, add, out, n_out, n);
    m = tile<2, rows<2>>(type, weights, a, m, end, add, out, n_out, n);
    tile<1, rows<1>>(type, weights, a, m, end, add, out, n_out, n);
  }
}

// Every type is read packed (lanes.h); the file's own layouts go to the AVX2 kernels, as do Q4_0, Q5_0 and Q8_0 rows
// that are not whole units of 128.
bool takes(int64_t type, int64_t) { return is_packed(type) && !is_tiled(type); }

int64_t layout(int64_t type, int64_t k, int64_t) {
  const bool whole = type == Q4_K || type == Q6_K || ((type == Q4_0 || type == Q5_0 || type == Q8_0) && k % 128 == 0);
  return whole ? type + 256 : type;
}

bool packed(int64_t) { return true; }

}  // namespace

const Kernels kernels = {"avx512-vnni", packed, 1, takes, layout, quantize, matmul};

}  // namespace avx512
}  // namespace specchat
