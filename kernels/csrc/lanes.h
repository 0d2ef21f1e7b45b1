// The AVX-512 kernels' lane order, and the K-quant layouts they read: a Q4_K or Q6_K tensor's blocks rearranged once,
// at load, so that each 64-byte vector of codes comes out of one load and a shift (the values are the file's, bit
// for bit; unpack gives the file's bytes back). Plain C++, free of instruction-set flags.
#pragma once
#include <cstdint>

#include "blocks.h"

namespace specchat {

constexpr int kLanes = 16;  // int32 lanes per 64-byte vector, and per unit

// Where each byte of a unit's vectors comes from: byte p = 64 t + 4 lane + e of the rearranged unit is the unit's
// weight (and activation) element[p]; group[lane] is the activation scale group (of 32) the lane's elements are in.
// A unit is a 256-weight K-quant block, or four Q5_0/Q8_0 blocks.
struct LaneOrder {
  int64_t unit = 0, vectors = 0;
  int16_t element[256] = {};
  int16_t group[kLanes] = {};
};

const LaneOrder& lane_order(int64_t type);  // type: a file type or its packed type

// Q4_K_LANES (148 bytes a block): 128 bytes of codes, vector h's byte j holding element[128 h + j] in its low nibble
// and element[128 h + 64 + j] in its high; the 8 scales and the 8 mins, a byte each; fp16 d and dmin.
// Q6_K_LANES (210 bytes): the low 4 bits as Q4_K_LANES's codes; 64 bytes of high 2 bits, byte j's bits 2t, 2t + 1
// for element[64 t + j]; the int8 scale of each lane's 16 values, by lane; fp16 d.
inline bool is_packed(int64_t type) { return type == Q4_K_LANES || type == Q6_K_LANES; }
inline int64_t file_type(int64_t type) { return type == Q4_K_LANES ? Q4_K : type == Q6_K_LANES ? Q6_K : type; }
void pack_blocks(int64_t file_type, const uint8_t* in, uint8_t* out, int64_t blocks);
void unpack_blocks(int64_t packed_type, const uint8_t* in, uint8_t* out, int64_t blocks);

}  // namespace specchat
