// The lane order of the AVX-512 kernels and the packed K-quant layouts (lanes.h).
#include "lanes.h"

#include <cstring>

namespace specchat {
namespace {

LaneOrder make_order(int64_t type) {
  LaneOrder order;
  const bool k_quant = type == Q4_K || type == Q6_K;
  order.unit = k_quant ? 256 : 128;
  order.vectors = order.unit / 64;
  for (int t = 0; t < order.vectors; ++t) {
    for (int lane = 0; lane < kLanes; ++lane) {
      for (int e = 0; e < 4; ++e) {
        int element;
        if (type == Q4_K) {  // lanes g and g + 8 are group g: the two halves of a vector add up to the 8 groups
          const int g = lane % 8, w = lane / 8;
          element = 32 * g + 8 * t + 4 * w + e;
        } else if (type == Q6_K) {  // lane 4m + i is the 16 values of sub-block 4i + m
          const int m = lane / 4, i = lane % 4;
          element = 16 * (4 * i + m) + 4 * t + e;
        } else {  // Q4_0, Q5_0, Q8_0: 128-bit lane m is 16 codes of block m, the first half in vector 0, the second in 1
          element = 32 * (lane / 4) + 16 * t + 4 * (lane % 4) + e;
        }
        order.element[64 * t + 4 * lane + e] = static_cast<int16_t>(element);
        order.group[lane] = static_cast<int16_t>(element / 32);
      }
    }
  }
  return order;
}

// The file's Q4_K: fp16 d, dmin; 12 bytes of 6-bit scales and mins; value e's 4-bit code in the low (e % 64 < 32) or
// high nibble of byte 32 (e / 64) + e % 32 of the codes.
int q4_k_code(const uint8_t* block, int e) {
  const uint8_t byte = block[16 + 32 * (e / 64) + e % 32];
  return e % 64 < 32 ? byte & 0x0F : byte >> 4;
}

void set_q4_k_code(uint8_t* block, int e, int code) {
  block[16 + 32 * (e / 64) + e % 32] |= static_cast<uint8_t>(e % 64 < 32 ? code : code << 4);
}

// The file's Q6_K: value p = 128 h + 32 c + l has its low 4 bits in the low (c < 2) or high nibble of byte
// 64 h + 32 (c % 2) + l, its high 2 bits at bit 2c of byte 128 + 32 h + l; 16 int8 scales at 192; fp16 d at 208.
int q6_k_code(const uint8_t* block, int p) {
  const int h = p / 128, c = p % 128 / 32, l = p % 32;
  const int low = (block[64 * h + 32 * (c % 2) + l] >> (4 * (c / 2))) & 0x0F;
  return low | (((block[128 + 32 * h + l] >> (2 * c)) & 0x03) << 4);
}

void set_q6_k_code(uint8_t* block, int p, int code) {
  const int h = p / 128, c = p % 128 / 32, l = p % 32;
  block[64 * h + 32 * (c % 2) + l] |= static_cast<uint8_t>((code & 0x0F) << (4 * (c / 2)));
  block[128 + 32 * h + l] |= static_cast<uint8_t>((code >> 4) << (2 * c));
}

// Packed codes: the 4-bit part of element[64 t + j] in nibble t % 2 of byte 64 (t / 2) + j; Q6_K's high 2 bits at
// bit 2t of byte 128 + j.
void put_packed(uint8_t* out, int t, int j, int code, bool six_bits) {
  out[64 * (t / 2) + j] |= static_cast<uint8_t>((code & 0x0F) << (4 * (t % 2)));
  if (six_bits) out[128 + j] |= static_cast<uint8_t>((code >> 4) << (2 * t));
}

int packed_code(const uint8_t* in, int t, int j, bool six_bits) {
  const int low = (in[64 * (t / 2) + j] >> (4 * (t % 2))) & 0x0F;
  return six_bits ? low | (((in[128 + j] >> (2 * t)) & 0x03) << 4) : low;
}

void q4_k_scales(const uint8_t* block, uint8_t* scale, uint8_t* min) {
  const uint8_t* q = block + 4;
  for (int g = 0; g < 8; ++g) {
    scale[g] = g < 4 ? q[g] & 0x3F : (q[g + 4] & 0x0F) | ((q[g - 4] >> 6) << 4);
    min[g] = g < 4 ? q[g + 4] & 0x3F : (q[g + 4] >> 4) | ((q[g] >> 6) << 4);
  }
}

void set_q4_k_scales(uint8_t* block, const uint8_t* scale, const uint8_t* min) {
  uint8_t* q = block + 4;
  for (int j = 0; j < 4; ++j) {
    q[j] = static_cast<uint8_t>(scale[j] | ((scale[j + 4] >> 4) << 6));
    q[j + 4] = static_cast<uint8_t>(min[j] | ((min[j + 4] >> 4) << 6));
    q[j + 8] = static_cast<uint8_t>((scale[j + 4] & 0x0F) | ((min[j + 4] & 0x0F) << 4));
  }
}

}  // namespace

const LaneOrder& lane_order(int64_t type) {
  static const LaneOrder q4_k = make_order(Q4_K), q6_k = make_order(Q6_K), q8 = make_order(Q8_0);
  type = file_type(type);
  return type == Q4_K ? q4_k : type == Q6_K ? q6_k : q8;
}

void pack_activations(int64_t type, const int8_t* natural, const float* scale, int8_t* row, int64_t k) {
  const LaneOrder& order = lane_order(type);
  const bool q4_k = file_type(type) == Q4_K;
  const int offset = file_type(type) == Q6_K ? 32 : file_type(type) == Q4_0 ? 8 : file_type(type) == Q5_0 ? 16
                                                                                  : file_type(type) == Q8_0 ? 128 : 0;
  for (int64_t u = 0; u < k / order.unit; ++u) {
    const int8_t* in = natural + u * order.unit;
    int8_t* out = row + u * (order.unit + kUnitExtra);
    for (int64_t p = 0; p < order.unit; ++p) out[p] = in[order.element[p]];
    float lane_scale[kLanes];
    int32_t lane_offset[kLanes];
    for (int lane = 0; lane < kLanes; ++lane) {
      int sum = 0;
      for (int64_t t = 0; t < order.vectors; ++t)
        for (int e = 0; e < 4; ++e) sum += out[64 * t + 4 * lane + e];
      lane_scale[lane] = scale[u * order.unit / 32 + order.group[lane]];
      lane_offset[lane] = q4_k ? sum : -offset * sum;
    }
    if (q4_k) {  // per group (lanes g and g + 8): 8 scales, then the float sums of its values
      for (int g = 0; g < 8; ++g) lane_scale[8 + g] = static_cast<float>(lane_offset[g] + lane_offset[g + 8]);
    }
    std::memcpy(out + order.unit, lane_scale, sizeof lane_scale);
    std::memcpy(out + order.unit + 64, lane_offset, sizeof lane_offset);
  }
}

namespace {

void pack_k_quants(int64_t type, const uint8_t* in, uint8_t* out, int64_t blocks) {
  const LaneOrder& order = lane_order(type);
  const bool six_bits = type == Q6_K;
  const int64_t in_bytes = six_bits ? 210 : 144, out_bytes = six_bits ? 210 : 148;
  for (int64_t b = 0; b < blocks; ++b, in += in_bytes, out += out_bytes) {
    std::memset(out, 0, static_cast<size_t>(out_bytes));
    for (int t = 0; t < 4; ++t) {
      for (int j = 0; j < 64; ++j) {
        const int e = order.element[64 * t + j];
        put_packed(out, t, j, six_bits ? q6_k_code(in, e) : q4_k_code(in, e), six_bits);
      }
    }
    if (six_bits) {
      for (int lane = 0; lane < kLanes; ++lane) out[192 + lane] = in[192 + order.element[4 * lane] / 16];
      std::memcpy(out + 208, in + 208, 2);
    } else {
      q4_k_scales(in, out + 128, out + 136);
      std::memcpy(out + 144, in, 4);
    }
  }
}

void unpack_k_quants(int64_t packed_type, const uint8_t* in, uint8_t* out, int64_t blocks) {
  const LaneOrder& order = lane_order(packed_type);
  const bool six_bits = packed_type == Q6_K_LANES;
  const int64_t in_bytes = six_bits ? 210 : 148, out_bytes = six_bits ? 210 : 144;
  for (int64_t b = 0; b < blocks; ++b, in += in_bytes, out += out_bytes) {
    std::memset(out, 0, static_cast<size_t>(out_bytes));
    for (int t = 0; t < 4; ++t) {
      for (int j = 0; j < 64; ++j) {
        const int e = order.element[64 * t + j], code = packed_code(in, t, j, six_bits);
        if (six_bits) set_q6_k_code(out, e, code); else set_q4_k_code(out, e, code);
      }
    }
    if (six_bits) {
      for (int lane = 0; lane < kLanes; ++lane) out[192 + order.element[4 * lane] / 16] = in[192 + lane];
      std::memcpy(out + 208, in + 208, 2);
    } else {
      set_q4_k_scales(out, in + 128, in + 136);
      std::memcpy(out, in + 144, 4);
    }
  }
}


// The file's Q5_0 (fp16 d, 32 fifth bits, 16 bytes of low 4 bits: value i < 16 in the low nibble of byte i, i >= 16
// in the high nibble of byte i - 16), Q4_0 (fp16 d, the 4-bit codes as Q5_0's low bits) and Q8_0 (fp16 d, 32 int8
// codes), four blocks a unit: unsigned codes (Q4_0's 0..15, Q5_0's 0..31, Q8_0's plus 128) of element e of the unit.
int64_t small_block_bytes(int64_t type) { return type == Q8_0 ? 34 : type == Q5_0 ? 22 : 18; }

int small_code(const uint8_t* unit, int64_t type, int e) {
  const int m = e / 32, i = e % 32;
  if (type == Q8_0) return static_cast<int8_t>(unit[34 * m + 2 + i]) + 128;
  const uint8_t* block = unit + small_block_bytes(type) * m;
  const uint8_t* low_bytes = block + (type == Q5_0 ? 6 : 2);
  const int low = i < 16 ? low_bytes[i] & 0x0F : low_bytes[i - 16] >> 4;
  return type == Q4_0 ? low : low | (((block[2 + i / 8] >> (i % 8)) & 1) << 4);
}

void set_small_code(uint8_t* unit, int64_t type, int e, int code) {
  const int m = e / 32, i = e % 32;
  if (type == Q8_0) {
    unit[34 * m + 2 + i] = static_cast<uint8_t>(code - 128);
    return;
  }
  uint8_t* block = unit + small_block_bytes(type) * m;
  block[(type == Q5_0 ? 6 : 2) + i % 16] |= static_cast<uint8_t>((code & 0x0F) << (i < 16 ? 0 : 4));
  if (type == Q5_0) block[2 + i / 8] |= static_cast<uint8_t>((code >> 4) << (i % 8));
}

void pack_small(int64_t type, const uint8_t* in, uint8_t* out, int64_t units) {
  const LaneOrder& order = lane_order(type);
  const bool q8 = type == Q8_0;
  const int64_t block = small_block_bytes(type), in_bytes = 4 * block, out_bytes = in_bytes, scales = out_bytes - 8;
  for (int64_t u = 0; u < units; ++u, in += in_bytes, out += out_bytes) {
    std::memset(out, 0, static_cast<size_t>(out_bytes));
    for (int p = 0; p < 128; ++p) {
      const int code = small_code(in, type, order.element[p]);
      if (q8) {
        out[p] = static_cast<uint8_t>(code);
      } else {
        out[p % 64] |= static_cast<uint8_t>((code & 0x0F) << (4 * (p / 64)));
        if (type == Q5_0) out[64 + p / 8] |= static_cast<uint8_t>((code >> 4) << (p % 8));
      }
    }
    for (int m = 0; m < 4; ++m) std::memcpy(out + scales + 2 * m, in + block * m, 2);
  }
}

void unpack_small(int64_t type, const uint8_t* in, uint8_t* out, int64_t units) {
  const LaneOrder& order = lane_order(type);
  const bool q8 = type == Q8_0;
  const int64_t block = small_block_bytes(type), in_bytes = 4 * block, scales = in_bytes - 8;
  for (int64_t u = 0; u < units; ++u, in += in_bytes, out += in_bytes) {
    std::memset(out, 0, static_cast<size_t>(in_bytes));
    for (int p = 0; p < 128; ++p) {
      const int low = (in[p % 64] >> (4 * (p / 64))) & 0x0F;
      const int code = q8 ? in[p] : type == Q4_0 ? low : low | (((in[64 + p / 8] >> (p % 8)) & 1) << 4);
      set_small_code(out, type, order.element[p], code);
    }
    for (int m = 0; m < 4; ++m) std::memcpy(out + block * m, in + scales + 2 * m, 2);
  }
}

}  // namespace

void pack_blocks(int64_t type, const uint8_t* in, uint8_t* out, int64_t units) {
  if (type == Q4_K || type == Q6_K) pack_k_quants(type, in, out, units);
  else pack_small(type, in, out, units);
}

void unpack_blocks(int64_t packed_type, const uint8_t* in, uint8_t* out, int64_t units) {
  const int64_t type = file_type(packed_type);
  if (type == Q4_K || type == Q6_K) unpack_k_quants(packed_type, in, out, units);
  else unpack_small(type, in, out, units);
}

namespace {

// One unit of 16 rows: `file` points at the first row's block, the next rows `stride` bytes apart. A code's byte and
// its nibble (or its 2 bits) in the tiled unit are found the same way when packing and unpacking.
void tile_unit(int64_t type, uint8_t* file, int64_t stride, uint8_t* tiled, bool pack) {
  // bytes that move whole: from the file's side to the tiled one when packing, back when unpacking
  const auto move = [pack](uint8_t* file_side, uint8_t* tiled_side, size_t bytes) {
    std::memcpy(pack ? tiled_side : file_side, pack ? file_side : tiled_side, bytes);
  };
  for (int n = 0; n < 16; ++n) {
    uint8_t* block = file + n * stride;
    if (type == Q4_0) {  // four blocks: their codes as Q4_K's groups 0..3, then their d
      for (int e = 0; e < 128; ++e) {
        const int g = e / 32, i = e % 32;
        const int at = 512 * (g / 2) + 64 * (i / 4) + 4 * n + i % 4, shift = 4 * (g % 2);
        if (pack) tiled[at] |= static_cast<uint8_t>(small_code(block, Q4_0, e) << shift);
        else set_small_code(block, Q4_0, e, (tiled[at] >> shift) & 0x0F);
      }
      for (int g = 0; g < 4; ++g) move(block + 18 * g, tiled + 1024 + 32 * g + 2 * n, 2);
      continue;
    }
    if (type == Q4_K) {
      for (int g = 0; g < 8; ++g) {
        for (int i = 0; i < 32; ++i) {
          const int at = 512 * (g / 2) + 64 * (i / 4) + 4 * n + i % 4, shift = 4 * (g % 2);
          if (pack) tiled[at] |= static_cast<uint8_t>(q4_k_code(block, 32 * g + i) << shift);
          else set_q4_k_code(block, 32 * g + i, (tiled[at] >> shift) & 0x0F);
        }
      }
      uint8_t scale[8], min[8];
      if (pack) q4_k_scales(block, scale, min);
      for (int g = 0; g < 8; ++g) {
        move(scale + g, tiled + 2048 + 16 * g + n, 1);
        move(min + g, tiled + 2176 + 16 * g + n, 1);
      }
      if (!pack) set_q4_k_scales(block, scale, min);
      move(block, tiled + 2304 + 2 * n, 2);      // d
      move(block + 2, tiled + 2336 + 2 * n, 2);  // dmin
      continue;
    }
    for (int p = 0; p < 256; ++p) {  // Q6_K
      const int row = p / 4, column = 4 * n + p % 4;
      const int low_at = 64 * (row % 32) + column, low_shift = 4 * (row / 32);
      const int high_at = 2048 + 64 * (row % 16) + column, high_shift = 2 * (row / 16);
      if (pack) {
        const int code = q6_k_code(block, p);
        tiled[low_at] |= static_cast<uint8_t>((code & 0x0F) << low_shift);
        tiled[high_at] |= static_cast<uint8_t>((code >> 4) << high_shift);
      } else {
        set_q6_k_code(block, p, ((tiled[low_at] >> low_shift) & 0x0F) | (((tiled[high_at] >> high_shift) & 0x03) << 4));
      }
    }
    for (int j = 0; j < 16; ++j) move(block + 192 + j, tiled + 3072 + 16 * j + n, 1);
    move(block + 208, tiled + 3328 + 2 * n, 2);
  }
}

void tiles(int64_t type, uint8_t* file, uint8_t* tiled, int64_t rows, int64_t units, bool pack) {
  // a row's bytes per unit (Q4_0: four blocks), and a unit's (Q4_K_TILES: four bytes more a row)
  const int64_t block = type == Q4_0 ? 72 : type == Q4_K ? 144 : 210, unit = 16 * block + (type == Q4_K ? 64 : 0);
  const int64_t row_bytes = units * block, tiled_row_bytes = units * unit / 16;
  for (int64_t row = 0; row < rows; row += 16) {
    for (int64_t u = 0; u < units; ++u) {
      uint8_t* first = file + row * row_bytes + u * block;
      uint8_t* packed = tiled + row * tiled_row_bytes + u * unit;
      if (pack) std::memset(packed, 0, static_cast<size_t>(unit));
      else for (int n = 0; n < 16; ++n) std::memset(first + n * row_bytes, 0, static_cast<size_t>(block));
      tile_unit(type, first, row_bytes, packed, pack);
    }
  }
}

}  // namespace

void pack_tiles(int64_t type, const uint8_t* in, uint8_t* out, int64_t rows, int64_t units) {
  tiles(type, const_cast<uint8_t*>(in), out, rows, units, true);
}

void unpack_tiles(int64_t tiled_type, const uint8_t* in, uint8_t* out, int64_t rows, int64_t units) {
  tiles(file_type(tiled_type), out, const_cast<uint8_t*>(in), rows, units, false);
}

}  // namespace specchat
