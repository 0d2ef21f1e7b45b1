// AVX2 + FMA + F16C kernels. Every row is computed by the same instructions in the same order whatever the number of
// rows and whichever thread runs it: a row's result has the same bits in a verify as in a one-token step.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "blocks.h"
#include "lanes.h"

namespace specchat {
namespace avx2 {
namespace {

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// The weights stream from memory once: ask for the cache lines of the blocks `ahead` bytes on, which the hardware
// prefetcher alone brings too late while the dot products run.
inline void prefetch(const uint8_t* p, int64_t bytes) {
  constexpr int64_t ahead = 1024;
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + ahead + line), _MM_HINT_T0);
}

// Shuffle masks: int16 lane i of a 128-bit half in every lane (`word`); in the low half lane i, in the high half
// lane i + 1 (`word_pair`: two scales, one per 16 weights of a maddubs product).
inline __m256i word(int i) { return _mm256_set1_epi16(static_cast<int16_t>((2 * i + 1) << 8 | 2 * i)); }
inline __m256i word_pair(int i) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>((2 * i + 3) << 8 | (2 * i + 2))),
                          _mm_set1_epi16(static_cast<int16_t>((2 * i + 1) << 8 | 2 * i)));
}
const __m128i kMinPairs = _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);

void quantize(int64_t, const float* x, int64_t row0, int64_t rows, const Activations& a) {
  auto* q = const_cast<int8_t*>(a.q);
  auto* d = const_cast<float*>(a.d);
  auto* s = const_cast<int16_t*>(a.s);
  const int64_t groups = a.k / a.group;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t m = row0; m < row0 + rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xs = x + m * a.k + g * a.group;
      __m256 amax = _mm256_setzero_ps();
      for (int64_t i = 0; i < a.group; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xs + i)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float top = _mm_cvtss_f32(m4);
      d[m * groups + g] = top / 127.0f;
      const __m256 inverse = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
      int8_t* qs = q + m * a.k + g * a.group;
      int16_t* ss = s + (m * a.k + g * a.group) / 16;
      for (int64_t i = 0; i < a.group; i += 16) {
        int sum = 0;
        for (int64_t j = i; j < i + 16; j += 8) {
          const __m256i v = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xs + j), inverse),
                                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
          alignas(32) int32_t lanes[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
          for (int l = 0; l < 8; ++l) {
            const int value = lanes[l] > 127 ? 127 : lanes[l] < -127 ? -127 : lanes[l];
            qs[j + l] = static_cast<int8_t>(value);
            sum += value;
          }
        }
        ss[i / 16] = static_cast<int16_t>(sum);
      }
    }
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
    prefetch(block, 144);
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
  for (int r = 0; r < R; ++r) result[r] = hsum(acc[r]);
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
    prefetch(block, 210);
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
  for (int r = 0; r < R; ++r) result[r] = hsum(acc[r]);
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
    prefetch(block, 34);
    const float d = half(block);
    const __m256i codes = load(block + 2);
    const __m256i magnitude = _mm256_sign_epi8(codes, codes);
    for (int r = 0; r < R; ++r) {
      const __m256i y = _mm256_sign_epi8(load(a.q + (row0 + r) * a.k + b * 32), codes);
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, y), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * a.d[(row0 + r) * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = hsum(acc[r]);
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
    prefetch(block, bytes);
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
  for (int r = 0; r < R; ++r) result[r] = hsum(acc[r]);
}

template <int R>
void rows(int64_t type, const uint8_t* w, const Activations& a, int64_t row0, float* result) {
  switch (type) {
    case Q4_0: q5_0<R, false>(w, a, row0, result); break;
    case Q4_K: q4_k<R>(w, a, row0, result); break;
    case Q6_K: q6_k<R>(w, a, row0, result); break;
    case Q8_0: q8_0<R>(w, a, row0, result); break;
    case Q5_0: q5_0<R, true>(w, a, row0, result); break;
  }
}

void matmul(int64_t type, const uint8_t* w, int64_t row_bytes, const Activations& a, int64_t row0, int64_t count,
            const float* bias, float* out, int64_t n_out, int64_t n0, int64_t n1) {
  float result[4];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* weights = w + n * row_bytes;
    const float add = bias ? bias[n] : 0.0f;
    int64_t m = row0;
    for (; m + 4 <= row0 + count; m += 4) {
      rows<4>(type, weights, a, m, result);
      for (int r = 0; r < 4; ++r) out[(m + r) * n_out + n] = result[r] + add;
    }
    if (m + 2 <= row0 + count) {
      rows<2>(type, weights, a, m, result);
      for (int r = 0; r < 2; ++r) out[(m + r) * n_out + n] = result[r] + add;
      m += 2;
    }
    for (; m < row0 + count; ++m) {
      rows<1>(type, weights, a, m, result);
      out[m * n_out + n] = result[0] + add;
    }
  }
}

bool takes(int64_t type, int64_t) { return !is_packed(type); }
int64_t layout(int64_t type, int64_t, int64_t) { return type; }

}  // namespace

const Kernels kernels = {"avx2", false, 1, takes, layout, quantize, matmul};

}  // namespace avx2
}  // namespace specchat
