// AMX-INT8 and AVX-512 VNNI kernels for Q4_K, Q6_K and Q4_0 weights packed as tiles (lanes.h): 16 output columns at a time.
// Built twice: with AMX (-mamx-int8: the "amx-int8" set) and without (blocks_tiles.cpp: "avx512-tiles", VNNI only).
// The exact int32 dot products of the rows with the 16 columns, one vector of 16 per row and scale group, come from
// one tile multiply per group for 9 to 16 rows of Q4_K or Q4_0, else from VNNI (each tile row of codes times
// the row's four activations, broadcast); the float steps then run on vectors of the 16 columns. A unit's codes are decoded once per
// call whatever the number of rows.
// The int32 sums are exact whichever instructions make them, and each output value then takes the same float steps
// in the same order whatever the number of rows and the thread: a row's result has the same bits in a verify as in a
// one-token step. Q5_0 and Q8_0 (and Q4_0 rows that are not whole units of 128) go to the AVX-512 kernels.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "blocks.h"
#include "lanes.h"

namespace specchat {
#ifdef __AMX_INT8__
namespace amx {
#else
namespace avx512_tiles {
#endif
namespace {

inline __m512i load(const void* p) { return _mm512_loadu_si512(p); }
inline void store(void* p, __m512i v) { _mm512_storeu_si512(p, v); }
inline __m512 halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

#ifdef __AMX_INT8__
constexpr bool kAmx = true;
constexpr long kRequestPermission = 0x1023;  // arch_prctl ARCH_REQ_XCOMP_PERM
constexpr long kTileData = 18;               // XFEATURE_XTILEDATA

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kGroup = 32;  // values a tile multiply takes: one scale group of Q4_K, one block of Q4_0

// Tiles 0-2 and 3-5: activations (rows x 32 bytes), weights (8 rows x 64 bytes), int32 sums (rows x 16); two sets, so
// that one group's multiply runs while the next group's tiles load.
void configure(int64_t rows) {
  TileConfig config;
  for (int set = 0; set < 2; ++set) {
    config.rows[3 * set] = static_cast<uint8_t>(rows);
    config.bytes[3 * set] = static_cast<uint16_t>(kGroup);
    config.rows[3 * set + 1] = static_cast<uint8_t>(kGroup / 4);
    config.bytes[3 * set + 1] = 64;
    config.rows[3 * set + 2] = static_cast<uint8_t>(rows);
    config.bytes[3 * set + 2] = 64;
  }
  asm volatile("" : : "r"(&config) : "memory");  // GCC does not see ldtilecfg read the config: keep its stores
  _tile_loadconfig(&config);
}

// The int32 sums of `groups` scale groups of 32 values, group t from activations `x` + 32 t (stride k) and weights
// `b` + 512 t (as tiles: the group's values in fours, 16 columns each), into `sums` + 256 t.
void multiply(const int8_t* x, int64_t k, const uint8_t* b, int groups, int32_t* sums) {
  for (int t = 0; t < groups; t += 2) {
    _tile_loadd(0, x + t * kGroup, k);
    _tile_loadd(1, b + t * kGroup * 16, 64);
    _tile_zero(2);
    _tile_loadd(3, x + (t + 1) * kGroup, k);
    _tile_loadd(4, b + (t + 1) * kGroup * 16, 64);
    _tile_zero(5);
    _tile_dpbsud(2, 0, 1);
    _tile_dpbsud(5, 3, 4);
    _tile_stored(2, sums + t * 256, 64);
    _tile_stored(5, sums + (t + 1) * 256, 64);
  }
}
#else
constexpr bool kAmx = false;
#endif

// The int32 sums of one row with one scale group's tile rows of codes (16 columns, four values a row) with VNNI:
// each tile row times the row's four activations there, broadcast, added to `start`; two chains for half the latency.
template <int kCount>
inline __m512i dot_vnni(const __m512i* codes, const int8_t* x, __m512i start = _mm512_setzero_si512()) {
  const int32_t* quads = reinterpret_cast<const int32_t*>(x);
  __m512i even = start, odd = _mm512_setzero_si512();
  for (int r = 0; r < kCount; r += 2) {
    even = _mm512_dpbusd_epi32(even, codes[r], _mm512_set1_epi32(quads[r]));
    odd = _mm512_dpbusd_epi32(odd, codes[r + 1], _mm512_set1_epi32(quads[r + 1]));
  }
  return _mm512_add_epi32(even, odd);
}

// The rows' terms the float steps take per scale group, as floats or int32 ready to broadcast.
struct RowTerms {
  const int8_t* x;       // (rows, k) int8
  const float* scale;    // (rows, k / 32): the activations' scales
  const float* sums;     // (rows, k / 32): Q4_K: the sums of each group's int8 values
  const int32_t* offset; // the codes' offset: Q6_K (rows, k / 16), -32 times the sums of each 16 int8 values;
                         // Q4_0 (rows, k / 32), 8 times the sums of each 32
  int64_t k, rows;
  int64_t ahead;         // Activations::ahead
};

// Q4_K_TILES (four pairs of groups) and Q4_0_TILES (two): each pair's nibbles a byte each, group 2p then 2p + 1.
template <int kPairs>
inline void decode_nibbles(const uint8_t* unit, uint8_t* codes) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int p = 0; p < kPairs; ++p) {
    for (int r = 0; r < 8; ++r) {
      const __m512i both = load(unit + 512 * p + 64 * r);
      store(codes + 1024 * p + 64 * r, _mm512_and_si512(both, nibble));
      store(codes + 1024 * p + 512 + 64 * r, _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble));
    }
  }
}

// Tile rows 4q.., 16 + 4q.., 32 + 4q.., 48 + 4q.. of a Q6_K_TILES unit (sub-blocks q, 4 + q, 8 + q, 12 + q), one
// code a byte: out[h][i] is row 16 h + 4 q + i.
inline void decode_q6_k(const uint8_t* unit, int q, __m512i (&out)[4][4]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
  for (int i = 0; i < 4; ++i) {
    const __m512i first = load(unit + 64 * (4 * q + i)), second = load(unit + 64 * (16 + 4 * q + i));
    const __m512i top = load(unit + 2048 + 64 * (4 * q + i));
    out[0][i] = _mm512_or_si512(_mm512_and_si512(first, nibble), _mm512_and_si512(_mm512_slli_epi16(top, 4), high));
    out[1][i] = _mm512_or_si512(_mm512_and_si512(second, nibble), _mm512_and_si512(_mm512_slli_epi16(top, 2), high));
    out[2][i] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(first, 4), nibble), _mm512_and_si512(top, high));
    out[3][i] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(second, 4), nibble),
                                _mm512_and_si512(_mm512_srli_epi16(top, 2), high));
  }
}

// Q4_K_TILES: weight = d * scale * code - dmin * min, groups of 32. A row's float step for group g: the float sum
// (scale times the int32 sum, less the min times the int8 values' sum) times the activations' scale, accumulated.
struct Q4Scales {
  __m512 scale[8], min[8];
  explicit Q4Scales(const uint8_t* unit) {
    const __m512 d = halves(unit + 2304), dmin = halves(unit + 2336);
    for (int g = 0; g < 8; ++g) {
      scale[g] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 2048 + 16 * g)))));
      min[g] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 2176 + 16 * g)))));
    }
  }
  __m512 step(__m512 total, __m512i dot, int g, const RowTerms& t, int64_t m, int64_t u) const {
    const int64_t at = m * (t.k / 32) + u * 8 + g;
    const __m512 value = _mm512_fnmadd_ps(_mm512_set1_ps(t.sums[at]), min[g], _mm512_mul_ps(_mm512_cvtepi32_ps(dot), scale[g]));
    return _mm512_fmadd_ps(value, _mm512_set1_ps(t.scale[at]), total);
  }
};

// Q6_K_TILES: weight = d * scale * (code - 32), sub-blocks of 16 with an int8 scale each, activations' scales per 32.
// The sub-blocks' float steps run in the order the VNNI path decodes them: 4h + q for q = 0..3, h = 0..3.
struct Q6Scales {
  __m512 scale[16];
  explicit Q6Scales(const uint8_t* unit) {
    const __m512 d = halves(unit + 3328);
    for (int j = 0; j < 16; ++j)
      scale[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 3072 + 16 * j)))));
  }
  // `exact`: the sub-block's int32 sum with the codes' offset taken off (the VNNI path starts its sum there)
  __m512 step(__m512 total, __m512i exact, int j, const RowTerms& t, int64_t m, int64_t u) const {
    const __m512 x_scale = _mm512_set1_ps(t.scale[m * (t.k / 32) + u * 8 + j / 2]);
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), scale[j]), x_scale, total);
  }
};

// Q4_0_TILES: weight = d * (code - 8), blocks of 32. A row's float step for block g: the int32 sum less 8 times the
// int8 values' sum there (exact), times d and the activations' scale, accumulated.
struct Q40Scales {
  __m512 d[4];
  explicit Q40Scales(const uint8_t* unit) {
    for (int g = 0; g < 4; ++g) d[g] = halves(unit + 1024 + 32 * g);
  }
  __m512 step(__m512 total, __m512i dot, int g, const RowTerms& t, int64_t m, int64_t u) const {
    const int64_t at = m * (t.k / 32) + u * 4 + g;
    const __m512i exact = _mm512_sub_epi32(dot, _mm512_set1_epi32(t.offset[at]));
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), d[g]), _mm512_set1_ps(t.scale[at]), total);
  }
};

// How far ahead of the codes a unit reads their lines are asked for: as set (bytes), else one unit (2 KB) for one
// row and two for several, whose VNNI then waits on memory less (docs/kernels.md).
inline int64_t ahead(const RowTerms& t, int64_t unit) { return t.ahead ? t.ahead : t.rows == 1 ? unit : 2 * unit; }

// A unit for every row with VNNI, the codes decoded in registers and each group's sums taken to the float step at once.
template <class Scales, int kPairs>
inline void vnni_nibbles(const uint8_t* unit, int64_t u, const RowTerms& t, float* acc) {
  const Scales scales(unit);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const int8_t* x = t.x + u * 64 * kPairs;
  for (int p = 0; p < kPairs; ++p) {
    __m512i low[8], high[8];
    for (int r = 0; r < 8; ++r) {
      const __m512i both = load(unit + 512 * p + 64 * r);
      _mm_prefetch(reinterpret_cast<const char*>(unit + 512 * p + 64 * r + ahead(t, 2048)), _MM_HINT_T0);
      low[r] = _mm512_and_si512(both, nibble);
      high[r] = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
    }
    for (int64_t m = 0; m < t.rows; ++m) {
      const int8_t* row = x + m * t.k + 64 * p;
      __m512 total = _mm512_load_ps(acc + 16 * m);
      total = scales.step(total, dot_vnni<8>(low, row), 2 * p, t, m, u);
      total = scales.step(total, dot_vnni<8>(high, row + 32), 2 * p + 1, t, m, u);
      _mm512_store_ps(acc + 16 * m, total);
    }
  }
}

inline void vnni_q6_k(const uint8_t* unit, int64_t u, const RowTerms& t, float* acc) {
  const Q6Scales scales(unit);
  const int8_t* x = t.x + u * 256;
  for (int q = 0; q < 4; ++q) {
    __m512i rows[4][4];
    decode_q6_k(unit, q, rows);
    for (int i = 0; i < 14; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(unit + ahead(t, 3360) + 64 * (14 * q + i)), _MM_HINT_T0);
    for (int64_t m = 0; m < t.rows; ++m) {
      __m512 total = _mm512_load_ps(acc + 16 * m);
      for (int h = 0; h < 4; ++h) {
        const int j = 4 * h + q;
        const __m512i offset = _mm512_set1_epi32(t.offset[m * (t.k / 16) + u * 16 + j]);
        total = scales.step(total, dot_vnni<4>(rows[h], x + m * t.k + 16 * j, offset), j, t, m, u);
      }
      _mm512_store_ps(acc + 16 * m, total);
    }
  }
}

// A unit for every row from the tile multiplies' sums (sums + 256 g + 16 m: group g, row m), in the same order.
template <class Scales, int kGroups>
inline void floats_groups(const uint8_t* unit, int64_t u, const RowTerms& t, const int32_t* sums, float* acc) {
  const Scales scales(unit);
  for (int64_t m = 0; m < t.rows; ++m) {
    __m512 total = _mm512_load_ps(acc + 16 * m);
    for (int g = 0; g < kGroups; ++g) total = scales.step(total, _mm512_load_si512(sums + 256 * g + 16 * m), g, t, m, u);
    _mm512_store_ps(acc + 16 * m, total);
  }
}

// A unit's float steps from its tile multiplies' sums.
template <int64_t kType>
inline void floats(const uint8_t* unit, int64_t u, const RowTerms& t, const int32_t* sums, float* acc) {
  if constexpr (kType == Q4_0_TILES) floats_groups<Q40Scales, 4>(unit, u, t, sums, acc);
  else floats_groups<Q4Scales, 8>(unit, u, t, sums, acc);
}

// One column tile's sums over all units. With tiles, the next unit's codes are decoded while this unit's multiplies
// run, then the unit before's float steps read the sums its multiplies stored: no load waits on the stores just made.
template <int64_t kType, bool kTiles>
void columns(const uint8_t* w, const RowTerms& t, float* acc) {
  constexpr bool six = kType == Q6_K_TILES, q4_0 = kType == Q4_0_TILES;
  static_assert(!(six && kTiles), "Q6_K takes VNNI only");
  constexpr int64_t bytes = six ? 3360 : q4_0 ? 1152 : 2368, groups = six ? 16 : q4_0 ? 4 : 8;
  constexpr int64_t values = q4_0 ? 128 : 256;  // a unit's, per row
  alignas(64) uint8_t codes[2][kTiles ? 4096 : 64];
  alignas(64) int32_t sums[2][kTiles ? groups * 256 : 16];
  const int64_t units = t.k / values;
  if constexpr (kTiles) decode_nibbles<groups / 2>(w, codes[0]);
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = w + u * bytes;
    if constexpr (kTiles) {
#ifdef __AMX_INT8__
      multiply(t.x + u * values, t.k, codes[u % 2], groups, sums[u % 2]);
      if (u + 1 < units) decode_nibbles<groups / 2>(unit + bytes, codes[(u + 1) % 2]);
      for (int64_t line = 0; u + 2 < units && line < bytes; line += 64)  // the decode after next's weights
        _mm_prefetch(reinterpret_cast<const char*>(unit + 2 * bytes + line), _MM_HINT_T0);
      if (u > 0) floats<kType>(unit - bytes, u - 1, t, sums[(u - 1) % 2], acc);
      if (u + 1 == units) floats<kType>(unit, u, t, sums[u % 2], acc);
#endif
    } else {
      if constexpr (six) vnni_q6_k(unit, u, t, acc);
      else if constexpr (q4_0) vnni_nibbles<Q40Scales, 2>(unit, u, t, acc);
      else vnni_nibbles<Q4Scales, 4>(unit, u, t, acc);
    }
  }
}

void quantize(int64_t type, const float* x, int64_t row0, int64_t rows, const Activations& a) {
  avx2::kernels.quantize(type, x, row0, rows, a);  // the activations in order, as the AVX2 kernels read them
}

// Nine rows or more of Q4_K or Q4_0 take the tile multiplies (a tile of fewer rows for 9..15), fewer take VNNI (the same
// integers): below that the codes' staging for the tiles costs more than VNNI's multiplies, and Q6_K's sub-blocks of 16
// fill only a quarter of a tile multiply, so its rows always take VNNI (docs/kernels.md).
constexpr int64_t kFewestTileRows = 9;

void matmul(int64_t type, const uint8_t* w, int64_t row_bytes, const Activations& a, int64_t row0, int64_t count,
            const float* bias, float* out, int64_t n_out, int64_t n0, int64_t n1) {
  const bool six = type == Q6_K_TILES, q4_k = type == Q4_K_TILES, tiles = kAmx && count >= kFewestTileRows && !six;
  const int64_t groups = a.k / 32;
  std::vector<float> sums(static_cast<size_t>(q4_k ? count * groups : 0));
  std::vector<int32_t> offsets(static_cast<size_t>(q4_k ? 0 : six ? count * 2 * groups : count * groups));
  for (int64_t m = 0; m < count; ++m) {
    const int16_t* s = a.s + (row0 + m) * 2 * groups;  // the sums of each 16 int8 values
    if (six) {
      for (int64_t j = 0; j < 2 * groups; ++j) offsets[m * 2 * groups + j] = -32 * s[j];
    } else {
      for (int64_t g = 0; g < groups; ++g) {
        const int32_t group_sum = s[2 * g] + s[2 * g + 1];
        if (q4_k) sums[m * groups + g] = static_cast<float>(group_sum);
        else offsets[m * groups + g] = 8 * group_sum;  // Q4_0
      }
    }
  }
  const RowTerms terms{a.q + row0 * a.k, a.d + row0 * groups, sums.data(), offsets.data(), a.k, count, a.ahead};
#ifdef __AMX_INT8__
  if (tiles) configure(count);
#endif
  alignas(64) float acc[16 * 16];
  const auto run = six ? columns<Q6_K_TILES, false>
                   : q4_k ? (tiles ? columns<Q4_K_TILES, true> : columns<Q4_K_TILES, false>)
                   : (tiles ? columns<Q4_0_TILES, true> : columns<Q4_0_TILES, false>);
  for (int64_t n = n0; n < n1; n += 16) {
    std::memset(acc, 0, sizeof acc);
    const uint8_t* weights = w + n * row_bytes;  // 16 weight rows, interleaved
    run(weights, terms, acc);
    const __m512 add = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
    for (int64_t m = 0; m < count; ++m)
      _mm512_storeu_ps(out + (row0 + m) * n_out + n, _mm512_add_ps(_mm512_load_ps(acc + 16 * m), add));
  }
#ifdef __AMX_INT8__
  if (tiles) _tile_release();
#endif
}

bool takes(int64_t type, int64_t) { return is_tiled(type); }

int64_t layout(int64_t type, int64_t k, int64_t n) {
  const bool tiled = type == Q4_K || type == Q6_K || (type == Q4_0 && k % 128 == 0);
  return tiled && n % 16 == 0 ? tiled_type(type) : avx512::kernels.layout(type, k, n);
}

}  // namespace

#ifdef __AMX_INT8__
bool available() {
  static const bool ready = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tiles = (edx >> 24) & 1, int8 = (edx >> 25) & 1;
    return tiles && int8 && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;  // the OS grants the tiles
  }();
  return ready;
}

const Kernels kernels = {"amx-int8", [](int64_t) { return false; }, 16, takes, layout, quantize, matmul};
#else
const Kernels kernels = {"avx512-tiles", [](int64_t) { return false; }, 16, takes, layout, quantize, matmul};
#endif

}  // namespace amx / avx512_tiles
}  // namespace specchat
