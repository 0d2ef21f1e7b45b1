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
// A unit is a 256-weight K-quant block, or four Q4_0/Q5_0/Q8_0 blocks.
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
// the four fp16 scales. Q4_0_LANES (72 bytes): the 4-bit codes as Q5_0_LANES's low bits; the four fp16 scales.
// One row's k int8 values in order and their scales (one per 32) as the packed kernels read them (Activations::packed):
// per unit the values in the type's lane order, then per lane the group's scale and the int32 its sum starts from
// (minus the codes' offset times the lane's values: Q6_K's 32, Q4_0's 8, Q5_0's 16, Q8_0's 128 from its codes stored
// plus 128); for Q4_K the 8 group scales, then the float sums of each group's values.
void pack_activations(int64_t type, const int8_t* natural, const float* scale, int8_t* row, int64_t k);
inline bool is_packed(int64_t type) { return type > 256; }
inline bool is_tiled(int64_t type) { return type > 512; }
inline int64_t file_type(int64_t type) { return type % 256; }
inline int64_t tiled_type(int64_t file) { return 512 + file; }
void pack_blocks(int64_t file_type, const uint8_t* in, uint8_t* out, int64_t units);
void unpack_blocks(int64_t packed_type, const uint8_t* in, uint8_t* out, int64_t units);

// The AMX kernels' layouts: 16 rows (output columns) of K-quant blocks interleaved, unit by unit (one block of each
// of the 16 rows, 16 x the block's bytes), so that each scale group's codes are a tile of 16 columns: byte 64 r + 4 n +
// e of a group's tile is column n's code of the group's value 4 r + e.
// Q4_K_TILES (2368 bytes a unit): per pair p of groups, 8 rows of 64 bytes, group 2p's tile in the low nibbles and
// 2p + 1's in the high; the 6-bit scales then the mins, 16 bytes (one per column) a group; 16 fp16 d, 16 dmin.
// Q6_K_TILES (3360 bytes): the 64 tile rows (sub-block j's 16 values are rows 4 j..4 j + 3), low 4 bits: byte i < 2048
// holds row i / 64's in its low nibble and row i / 64 + 32's in its high; then 1024 bytes whose byte i holds the high
// 2 bits of rows i / 64, + 16, + 32, + 48 at bits 0, 2, 4, 6; the int8 scales, 16 bytes a sub-block; 16 fp16 d.
// Q4_0_TILES (1152 bytes a unit of four blocks): the codes as Q4_K_TILES's groups 0..3 (1024 bytes); 16 fp16 d a block.
// Each takes `rows` (a multiple of 16) rows of `units` units, row after row, and gives them in the other layout.
void pack_tiles(int64_t file_type, const uint8_t* in, uint8_t* out, int64_t rows, int64_t units);
void unpack_tiles(int64_t tiled_type, const uint8_t* in, uint8_t* out, int64_t rows, int64_t units);

}  // namespace specchat
