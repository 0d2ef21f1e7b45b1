// AVX2 + FMA + F16C kernels. Every row is computed by the same instructions in the same order whatever the number of
// rows and whichever thread runs it: a row's result has the same bits in a verify as in a one-token step.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "blocks.h"
#include "lanes.h"
#include "shared.h"

namespace specchat {
namespace avx2 {
namespace {

inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Shuffle masks: int16 lane i of a 128-bit half in every lane (`word`); in the low half lane i, in the high half
// lane i + 1 (`word_pair`: two scales, one per 16 weights of a maddubs product).
inline __m256i word(int i) { return _mm256_set1_epi16(static_cast<int16_t>((2 * i + 1) << 8 | 2 * i)); }
inline __m256i word_pair(int i) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>((2 * i + 3) << 8 | (2 * i + 2))),
                          _mm_set1_epi16(static_cast<int16_t>((2 * i + 1) << 8 | 2 * i)));
}
const __m128i kMinPairs = _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);

// One row of k values as int8, one scale (max |x| / 127) per `group` values into d, the sums of each 16 int8 values
// into s.
void round_row(const float* x, int64_t k, int64_t group, int8_t* q, float* d, int16_t* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i top_code = _mm256_set1_epi32(127), bottom_code = _mm256_set1_epi32(-127);
  for (int64_t g = 0; g < k / group; ++g) {
    const float* xs = x + g * group;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < group; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xs + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float top = _mm_cvtss_f32(m4);
    d[g] = top / 127.0f;
    const __m256 inverse = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    for (int64_t i = 0; i < group; i += 16) {
      __m256i v[2];
      for (int h = 0; h < 2; ++h) {
        const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(xs + i + 8 * h), inverse);
        v[h] = _mm256_cvtps_epi32(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        v[h] = _mm256_min_epi32(_mm256_max_epi32(v[h], bottom_code), top_code);
      }
      // int16 pairs of 4 come out lane-interleaved: put them back in order, then down to bytes
      const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xD8);
      const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * group + i), bytes);
      const __m256i eight = _mm256_add_epi32(v[0], v[1]);
      __m128i four = _mm_add_epi32(_mm256_castsi256_si128(eight), _mm256_extracti128_si256(eight, 1));
      four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0x4E));
      four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0xB1));
      s[(g * group + i) / 16] = static_cast<int16_t>(_mm_cvtsi128_si32(four));
    }
  }
}

// The packed layouts (lanes.h) these kernels read: every AVX-512 one but Q8_0's, whose codes plus 128 overflow
// maddubs' int16 sums.
bool lanes(int64_t type) {
  return type == Q4_K_LANES || type == Q6_K_LANES || type == Q4_0_LANES || type == Q5_0_LANES;
}

void quantize(int64_t type, const float* x, int64_t row0, int64_t rows, const Activations& a) {
  if (!lanes(type)) {  // the values in order (the AMX kernels read them so too)
    for (int64_t m = row0; m < row0 + rows; ++m)
      round_row(x + m * a.k, a.k, a.group, const_cast<int8_t*>(a.q) + m * a.k,
                const_cast<float*>(a.d) + m * (a.k / a.group), const_cast<int16_t*>(a.s) + m * (a.k / 16));
    return;
  }
  std::vector<int8_t> natural(static_cast<size_t>(a.k));
  std::vector<float> scale(static_cast<size_t>(a.k / 32));
  std::vector<int16_t> sums(static_cast<size_t>(a.k / 16));
  for (int64_t m = row0; m < row0 + rows; ++m) {
    round_row(x + m * a.k, a.k, 32, natural.data(), scale.data(), sums.data());
    pack_activations(type, natural.data(), scale.data(), const_cast<int8_t*>(a.packed) + m * a.row_stride, a.k);
  }
}

// Q4_K: 256 weights, fp16 d and dmin, 12 bytes of 6-bit scales and mins for 8 groups of 32, 128 bytes of 4-bit codes;
// weight = d * scale * code - dmin * min. A group's integer dot product (its 6-bit scale applied in int32) is
// converted once and scaled by the group's activation scale; the block's sum by d.
template <int R>
void q4_k(const uint8_t* w, const Activations& a, int64_t row0, float* result) {
  const int64_t blocks = a.k / 256, groups = a.k / 32;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * 144;
    prefetch(block, 144, a.ahead);
    const __m256 d = _mm256_set1_ps(half(block)), dmin = _mm256_set1_ps(half(block + 2));
    uint32_t u[3];
    std::memcpy(u, block + 4, 12);  // 6-bit scales and mins of the 8 groups, packed
    const uint32_t scale_low = u[0] & 0x3F3F3F3F, min_low = u[1] & 0x3F3F3F3F;
    const uint32_t scale_high = (u[2] & 0x0F0F0F0F) | (((u[0] >> 6) & 0x03030303) << 4);
    const uint32_t min_high = ((u[2] >> 4) & 0x0F0F0F0F) | (((u[1] >> 6) & 0x03030303) << 4);
    const __m128i bytes = _mm_setr_epi32(static_cast<int>(scale_low), static_cast<int>(scale_high),
                                         static_cast<int>(min_low), static_cast<int>(min_high));
    const __m256i lows = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(bytes, kMinPairs));  // each min for two sums of 16
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(bytes));  // int16 scales 0..7, both halves
    __m256 sum[R];  // the block's groups, each scaled by its activation scale (d comes once, after)
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
#pragma GCC unroll 1  // unrolled, the compiler hoists every group's codes and spills the accumulators
    for (int j = 0; j < 4; ++j) {
      const __m256i codes = load(block + 16 + 32 * j);
      const __m256i first = _mm256_and_si256(codes, nibble);
      const __m256i second = _mm256_and_si256(_mm256_srli_epi16(codes, 4), nibble);
      const __m256i scale_first = _mm256_shuffle_epi8(scales, word(2 * j));
      const __m256i scale_second = _mm256_shuffle_epi8(scales, word(2 * j + 1));
      for (int r = 0; r < R; ++r) {
        const int8_t* y = a.q + (row0 + r) * a.k + b * 256 + 64 * j;
        const float* ys = a.d + (row0 + r) * groups + b * 8 + 2 * j;
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(first, load(y)), scale_first);
        sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(ys), sum[r]);
        const __m256i q = _mm256_madd_epi16(_mm256_maddubs_epi16(second, load(y + 32)), scale_second);
        sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_broadcast_ss(ys + 1), sum[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256i mins = _mm256_madd_epi16(load(a.s + (row0 + r) * (a.k / 16) + b * 16), lows);  // per group
      const __m256 dmin_y = _mm256_mul_ps(dmin, _mm256_loadu_ps(a.d + (row0 + r) * groups + b * 8));
      acc[r] = _mm256_fmadd_ps(sum[r], d, acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), dmin_y, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = sum8(acc[r]);
}

// Q6_K: 256 weights, 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales (one per 16), fp16 d;
// weight = d * scale * (code - 32).
template <int R>
void q6_k(const uint8_t* w, const Activations& a, int64_t row0, float* result) {
  const int64_t blocks = a.k / 256, groups = a.k / 32;
  const __m256i nibble = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x03);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * 210;
    prefetch(block, 210, a.ahead);
    const int8_t* scale = reinterpret_cast<const int8_t*>(block + 192);  // one per 16 weights
    const __m256 d = _mm256_set1_ps(half(block + 208));
    const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale)));
    __m256 sum[R];  // the block's groups, each scaled by its activation scale (d comes once, after)
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      const __m256i low0 = load(block + 64 * h), low1 = load(block + 64 * h + 32), high = load(block + 128 + 32 * h);
      const __m256i codes[4] = {
          _mm256_or_si256(_mm256_and_si256(low0, nibble), _mm256_slli_epi16(_mm256_and_si256(high, pair), 4)),
          _mm256_or_si256(_mm256_and_si256(low1, nibble),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2), pair), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low0, 4), nibble),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 4), pair), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low1, 4), nibble),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 6), pair), 4))};
      const __m256i half_scales = _mm256_broadcastsi128_si256(h == 0 ? _mm256_castsi256_si128(scales)
                                                                       : _mm256_extracti128_si256(scales, 1));
      for (int c = 0; c < 4; ++c) {
        const __m256i s = _mm256_shuffle_epi8(half_scales, word_pair(2 * c));
        for (int r = 0; r < R; ++r) {
          const int8_t* y = a.q + (row0 + r) * a.k + b * 256 + 128 * h + 32 * c;
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(codes[c], load(y)), s);
          sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(a.d + (row0 + r) * groups + b * 8 + 4 * h + c),
                                   sum[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {  // the codes' offset of 32, per group: 32 * sum of scale * sum of 16
      const __m256i offset = _mm256_madd_epi16(load(a.s + (row0 + r) * (a.k / 16) + b * 16), scales);
      const __m256 ys = _mm256_loadu_ps(a.d + (row0 + r) * groups + b * 8);
      sum[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_slli_epi32(offset, 5)), ys, sum[r]);
      acc[r] = _mm256_fmadd_ps(sum[r], d, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = sum8(acc[r]);
}

// Q8_0: 32 weights, fp16 d, 32 int8 codes; weight = d * code.
template <int R>
void q8_0(const uint8_t* w, const Activations& a, int64_t row0, float* result) {
  const int64_t blocks = a.k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * 34;
    prefetch(block, 34, a.ahead);
    const float d = half(block);
    const __m256i codes = load(block + 2);
    const __m256i magnitude = _mm256_sign_epi8(codes, codes);
    for (int r = 0; r < R; ++r) {
      const __m256i y = _mm256_sign_epi8(load(a.q + (row0 + r) * a.k + b * 32), codes);
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, y), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * a.d[(row0 + r) * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = sum8(acc[r]);
}

// Q5_0: 32 weights, fp16 d, 32 high bits, 16 bytes of low 4 bits; weight = d * (code - 16). Q4_0 (kFifth false):
// fp16 d and the 4-bit codes alone; weight = d * (code - 8).
template <int R, bool kFifth>
void q5_0(const uint8_t* w, const Activations& a, int64_t row0, float* result) {
  constexpr int64_t bytes = kFifth ? 22 : 18;
  constexpr int offset_per_value = kFifth ? 16 : 8;
  const int64_t blocks = a.k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL), sixteen = _mm256_set1_epi8(0x10);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * bytes;
    prefetch(block, bytes, a.ahead);
    const float d = half(block);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + bytes - 16));
    __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble), _mm_and_si128(packed, nibble));
    if (kFifth) {
      uint32_t high_bits;
      std::memcpy(&high_bits, block + 2, 4);
      const __m256i spread_bits = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(high_bits)), spread), bit);
      codes = _mm256_or_si256(codes, _mm256_and_si256(_mm256_cmpeq_epi8(spread_bits, bit), sixteen));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = row0 + r;
      const int16_t* sums = a.s + row * (a.k / 16) + b * 2;
      const int offset = offset_per_value * (sums[0] + sums[1]);
      __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, load(a.q + row * a.k + b * 32)), ones);
      dot = _mm256_sub_epi32(dot, _mm256_setr_epi32(offset, 0, 0, 0, 0, 0, 0, 0));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * a.d[row * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = sum8(acc[r]);
}

// The packed layouts (lanes.h), read as the AVX-512 kernels read them, each 64-byte vector as two halves of 8 int32
// lanes. maddubs' int16 pair sums of a lane are added in int16 over as many vectors as cannot overflow (codes below 16:
// 16 products of 15 x 127; Q6_K's below 64: 8 products), then widened once: a unit costs a row about half the
// instructions of converting every group's sum.
inline __m256i widen(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }

// Q4_K_LANES: lanes g and g + 8 are group g, so both halves of a vector add into the same 8 groups; the float steps
// are the AVX-512 kernel's, in its order.
template <int R>
void q4_k_lanes(const uint8_t* w, const Activations& a, int64_t row0, float* result) {
  const int64_t units = a.k / 256;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* rows[R];
  packed_rows<R>(a, row0, rows);
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* block = w + u * 148;
    prefetch(block, 148, a.ahead);
    const int64_t at = u * (256 + kUnitExtra);
    __m256i pairs[R];
    for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int q = 0; q < 4; ++q) {  // 32 bytes of codes: vector 2 (q / 2) half q % 2, low nibbles, then high ones
      const __m256i codes = load(block + 32 * q);
      const __m256i low = _mm256_and_si256(codes, nibble), high = _mm256_and_si256(_mm256_srli_epi16(codes, 4), nibble);
      const int64_t first = at + 128 * (q / 2) + 32 * (q % 2);
      for (int r = 0; r < R; ++r) {
        pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(low, load(rows[r] + first)));
        pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(high, load(rows[r] + first + 64)));
      }
    }
    const Q4KLaneScales scales(block);
    for (int r = 0; r < R; ++r) acc[r] = scales.step(acc[r], widen(pairs[r]), rows[r] + at + 256);
  }
  for (int r = 0; r < R; ++r) result[r] = sum8(acc[r]);
}

// Q6_K_LANES: weight = d * scale * (code - 32); half h of each vector is lanes 8 h..8 h + 7, each a sub-block of 16.
template <int R>
void q6_k_lanes(const uint8_t* w, const Activations& a, int64_t row0, float* result) {
  const int64_t units = a.k / 256;
  const __m256i nibble = _mm256_set1_epi8(0x0F), high_pair = _mm256_set1_epi8(0x30);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* rows[R];
  packed_rows<R>(a, row0, rows);
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* block = w + u * 210;
    prefetch(block, 210, a.ahead);
    const int64_t at = u * (256 + kUnitExtra);
    const __m256 d = _mm256_set1_ps(half(block + 208));
#pragma GCC unroll 1
    for (int h = 0; h < 2; ++h) {
      const __m256i first = load(block + 32 * h), second = load(block + 64 + 32 * h), high = load(block + 128 + 32 * h);
      const __m256i codes[4] = {
          _mm256_or_si256(_mm256_and_si256(first, nibble), _mm256_and_si256(_mm256_slli_epi16(high, 4), high_pair)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(first, 4), nibble),
                          _mm256_and_si256(_mm256_slli_epi16(high, 2), high_pair)),
          _mm256_or_si256(_mm256_and_si256(second, nibble), _mm256_and_si256(high, high_pair)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(second, 4), nibble),
                          _mm256_and_si256(_mm256_srli_epi16(high, 2), high_pair))};
      const __m256 scales = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 192 + 8 * h)))));
      for (int r = 0; r < R; ++r) {
        const int8_t* y = rows[r] + at + 32 * h;
        const __m256i front = _mm256_add_epi16(_mm256_maddubs_epi16(codes[0], load(y)),
                                               _mm256_maddubs_epi16(codes[1], load(y + 64)));
        const __m256i back = _mm256_add_epi16(_mm256_maddubs_epi16(codes[2], load(y + 128)),
                                              _mm256_maddubs_epi16(codes[3], load(y + 192)));
        const __m256i dot = _mm256_add_epi32(_mm256_add_epi32(load(rows[r] + at + 320 + 32 * h), widen(front)),
                                             widen(back));
        const __m256 lanes = _mm256_loadu_ps(reinterpret_cast<const float*>(rows[r] + at + 256 + 32 * h));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), scales), lanes, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) result[r] = sum8(acc[r]);
}

// Q4_0_LANES and Q5_0_LANES: weight = d * (code - 8) and d * (code - 16); half h of each vector is blocks 2 h, 2 h + 1.
template <int R, bool kFifth>
void small_lanes(const uint8_t* w, const Activations& a, int64_t row0, float* result) {
  constexpr int64_t bytes = kFifth ? 88 : 72;
  const int64_t units = a.k / 128;
  const __m256i nibble = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(0x10);
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* rows[R];
  packed_rows<R>(a, row0, rows);
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = w + u * bytes;
    prefetch(unit, bytes, a.ahead);
    const int64_t at = u * (128 + kUnitExtra);
    const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit + bytes - 8)));
    const __m256 halves[2] = {_mm256_set_m128(_mm_shuffle_ps(d4, d4, 0x55), _mm_shuffle_ps(d4, d4, 0x00)),
                              _mm256_set_m128(_mm_shuffle_ps(d4, d4, 0xFF), _mm_shuffle_ps(d4, d4, 0xAA))};
#pragma GCC unroll 1
    for (int h = 0; h < 2; ++h) {
      const __m256i low = load(unit + 32 * h);
      __m256i codes[2] = {_mm256_and_si256(low, nibble), _mm256_and_si256(_mm256_srli_epi16(low, 4), nibble)};
      if (kFifth) {
        for (int t = 0; t < 2; ++t) {
          uint32_t fifth;
          std::memcpy(&fifth, unit + 64 + 8 * t + 4 * h, 4);
          const __m256i bits = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(fifth)), spread), bit);
          codes[t] = _mm256_or_si256(codes[t], _mm256_and_si256(_mm256_cmpeq_epi8(bits, bit), sixteen));
        }
      }
      const __m256 scales = halves[h];  // block 2 h's d in the low 4 lanes, 2 h + 1's in the high
      for (int r = 0; r < R; ++r) {
        const int8_t* y = rows[r] + at + 32 * h;
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(codes[0], load(y)),
                                               _mm256_maddubs_epi16(codes[1], load(y + 64)));
        const __m256i dot = _mm256_add_epi32(load(rows[r] + at + 192 + 32 * h), widen(pairs));
        const __m256 lanes = _mm256_loadu_ps(reinterpret_cast<const float*>(rows[r] + at + 128 + 32 * h));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), scales), lanes, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) result[r] = sum8(acc[r]);
}

template <int R>
void rows(int64_t type, const uint8_t* w, const Activations& a, int64_t row0, float* result) {
  switch (type) {
    case Q4_0: q5_0<R, false>(w, a, row0, result); break;
    case Q4_K: q4_k<R>(w, a, row0, result); break;
    case Q6_K: q6_k<R>(w, a, row0, result); break;
    case Q8_0: q8_0<R>(w, a, row0, result); break;
    case Q5_0: q5_0<R, true>(w, a, row0, result); break;
    case Q4_K_LANES: q4_k_lanes<R>(w, a, row0, result); break;
    case Q6_K_LANES: q6_k_lanes<R>(w, a, row0, result); break;
    case Q4_0_LANES: small_lanes<R, false>(w, a, row0, result); break;
    case Q5_0_LANES: small_lanes<R, true>(w, a, row0, result); break;
  }
}

void matmul(int64_t type, const uint8_t* w, int64_t row_bytes, const Activations& a, int64_t row0, int64_t count,
            const float* bias, float* out, int64_t n_out, int64_t n0, int64_t n1) {
  const int64_t end = row0 + count;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* weights = w + n * row_bytes;
    const float add = bias ? bias[n] : 0.0f;
    int64_t m = lanes(type) ? tile<8, rows<8>>(type, weights, a, row0, end, add, out, n_out, n) : row0;
    m = tile<4, rows<4>>(type, weights, a, m, end, add, out, n_out, n);
    m = tile<2, rows<2>>(type, weights, a, m, end, add, out, n_out, n);
    tile<1, rows<1>>(type, weights, a, m, end, add, out, n_out, n);
  }
}

bool takes(int64_t type, int64_t) { return !is_packed(type) || lanes(type); }

int64_t layout(int64_t type, int64_t k, int64_t) {
  const bool whole = type == Q4_K || type == Q6_K || ((type == Q4_0 || type == Q5_0) && k % 128 == 0);
  return whole ? type + 256 : type;
}

}  // namespace

const Kernels kernels = {"avx2", lanes, 1, takes, layout, quantize, matmul};

}  // namespace avx2
}  // namespace specchat
