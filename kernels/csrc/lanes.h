// The AVX-512 kernels' lane order, and the layouts they read: a tensor's blocks rearranged once, at load, so that
// each 64-byte vector of codes comes out of one load and a shift or a mask (the values are the file's, bit
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
// Q8_0_LANES (136 bytes a unit of four blocks): the codes plus 128 as unsigned bytes, vector t's byte j holding
// element[64 t + j]; the four fp16 scales. Q5_0_LANES (88 bytes): the low 4 bits of element[j] in the low nibble of
// byte j and of element[64 + j] in its high; 8 bytes whose bit j is element[j]'s fifth bit, 8 for element[64 + j];
// the four fp16 scales.
inline bool is_packed(int64_t type) { return type > 256; }
inline int64_t file_type(int64_t type) { return is_packed(type) ? type - 256 : type; }
void pack_blocks(int64_t file_type, const uint8_t* in, uint8_t* out, int64_t units);
void unpack_blocks(int64_t packed_type, const uint8_t* in, uint8_t* out, int64_t units);

}  // namespace specchat
