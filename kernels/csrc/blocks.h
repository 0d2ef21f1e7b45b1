// Matmul of float activations with weights in GGUF blocks (Q4_K, Q6_K, Q4_0, Q5_0, Q8_0): the interface between the
// torch op (ops.cpp) and one instruction set's kernels (blocks_<isa>.cpp), free of torch headers.
#pragma once
#include <cstdint>

namespace specchat {

// GGML's type ids, as the GGUF file names them; and the packed layouts the AVX-512 kernels read (lanes.h), whose
// blocks are units: one K-quant block, or four Q4_0/Q5_0/Q8_0 blocks.
enum BlockType : int64_t {
  Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14,
  Q4_0_LANES = 256 + Q4_0, Q5_0_LANES = 256 + Q5_0, Q8_0_LANES = 256 + Q8_0, Q4_K_LANES = 256 + Q4_K, Q6_K_LANES = 256 + Q6_K,
  Q4_0_TILES = 512 + Q4_0, Q4_K_TILES = 512 + Q4_K, Q6_K_TILES = 512 + Q6_K
};

struct BlockFormat {
  int64_t weights;  // per block
  int64_t bytes;    // per block
};

inline bool block_format(int64_t type, BlockFormat* format) {
  switch (type) {
    case Q4_0: *format = {32, 18}; return true;
    case Q5_0: *format = {32, 22}; return true;
    case Q8_0: *format = {32, 34}; return true;
    case Q4_K: *format = {256, 144}; return true;
    case Q6_K: *format = {256, 210}; return true;
    case Q4_0_LANES: *format = {128, 72}; return true;
    case Q5_0_LANES: *format = {128, 88}; return true;
    case Q8_0_LANES: *format = {128, 136}; return true;
    case Q4_K_LANES: *format = {256, 148}; return true;
    case Q6_K_LANES: *format = {256, 210}; return true;
    case Q4_0_TILES: *format = {128, 72}; return true;  // per row: a unit is 16 rows' four blocks interleaved
    case Q4_K_TILES: *format = {256, 148}; return true;  // per row: a unit is 16 rows' blocks interleaved
    case Q6_K_TILES: *format = {256, 210}; return true;
    default: return false;
  }
}

// Activations rounded to int8, one float scale per `group` (32) values. The AVX2 kernels read the values in order,
// the scales and the sums of each 16 consecutive values (the weights' offsets and mins are applied through them).
// The AVX-512 kernels read `packed`: per row (`row_stride` bytes) and per unit of their weights, the unit's values in
// the weights' lane order, then per int32 lane a float scale and an int32 offset (kUnitExtra bytes).
struct Activations {
  const int8_t* q;       // (rows, k)
  const float* d;        // (rows, k / group)
  const int16_t* s;      // (rows, k / 16)
  const int8_t* packed;  // (rows, row_stride)
  int64_t k;
  int64_t group;
  int64_t row_stride;  // 2 k: room for a unit of 128 values and its 128 bytes of lanes
  int64_t ahead;       // bytes ahead of the weights being read whose cache lines are asked for; 0: each layout's own
};

constexpr int64_t kUnitExtra = 128;  // 16 float scales and 16 int32 offsets after each unit's values

struct Kernels {
  const char* name;
  // Whether these kernels read Activations::packed for weights of this type (else q, d and s).
  bool (*packed)(int64_t type);
  int64_t columns;  // matmul takes whole multiples of this many output columns
  // Whether these kernels take a weight of this type with k inputs.
  bool (*takes)(int64_t type, int64_t k);
  // The type these kernels read a file type's weights of k inputs and n outputs in best (the type itself, or its packed layout).
  int64_t (*layout)(int64_t type, int64_t k, int64_t n);
  // Rows [row0, row0 + rows) of x (rows, k) float32 into `a` (whose pointers are cast back to writable), for a
  // weight of this type.
  void (*quantize)(int64_t type, const float* x, int64_t row0, int64_t rows, const Activations& a);
  // out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for rows [row0, row0 + rows) and columns [n0, n1).
  void (*matmul)(int64_t type, const uint8_t* w, int64_t row_bytes, const Activations& a, int64_t row0,
                 int64_t rows, const float* bias, float* out, int64_t n_out, int64_t n0, int64_t n1);
};

namespace avx2 {
extern const Kernels kernels;
}
namespace avx512 {
extern const Kernels kernels;
}
namespace avx512_tiles {
extern const Kernels kernels;
}
namespace amx {
bool available();  // the CPU has AMX-INT8 and the OS lets this process use its tiles
extern const Kernels kernels;
}

}  // namespace specchat
