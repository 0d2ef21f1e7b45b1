// The torch ops specchat::gguf_rows: rows of a GGUF tensor's blocks, dequantized to float32 (an embedding lookup: only
// the rows asked are decoded); and specchat::gguf_quantize: dense float32 weights into Q8_0 or Q4_0 blocks. Plain scalar code; each value is computed as the format's reference dequantization
// computes it (gguf-py's quants.dequantize, ggml's dequantize_row_*), in float32 with the same operations in order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "blocks.h"
#include "lanes.h"

namespace specchat {
namespace {

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K: fp16 d and dmin, 12 bytes of 6-bit scales and mins for 8 groups of 32, 128 bytes of 4-bit codes (group 2j in
// the low nibbles of bytes 32j..32j+31, group 2j+1 in their high nibbles); value = d * scale * code - dmin * min.
void q4_k(const uint8_t* block, float* y) {
  const float d = half(block), dmin = half(block + 2);
  const uint8_t* packed = block + 4;
  const uint8_t* codes = block + 16;
  for (int g = 0; g < 8; ++g) {
    const int scale = g < 4 ? packed[g] & 0x3F : (packed[g + 4] & 0x0F) | ((packed[g - 4] >> 6) << 4);
    const int min = g < 4 ? packed[g + 4] & 0x3F : (packed[g + 4] >> 4) | ((packed[g] >> 6) << 4);
    const float d_scale = d * static_cast<float>(scale), dmin_min = dmin * static_cast<float>(min);
    const int shift = 4 * (g % 2);
    for (int l = 0; l < 32; ++l) {
      const int code = (codes[32 * (g / 2) + l] >> shift) & 0x0F;
      y[32 * g + l] = d_scale * static_cast<float>(code) - dmin_min;
    }
  }
}

// Q6_K: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales (one per 16 values), fp16 d;
// value = d * scale * (code - 32). In each half of 128 values, chunk c of 32 takes the low (c < 2) or high nibbles
// of the low bytes 32 * (c % 2).. and bits 2c, 2c+1 of the high bytes.
void q6_k(const uint8_t* block, float* y) {
  const uint8_t* low = block;
  const uint8_t* high = block + 128;
  const int8_t* scale = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half(block + 208);
  for (int h = 0; h < 2; ++h) {
    for (int c = 0; c < 4; ++c) {
      for (int l = 0; l < 32; ++l) {
        const int position = 128 * h + 32 * c + l;
        const int low_bits = (low[64 * h + 32 * (c % 2) + l] >> (4 * (c / 2))) & 0x0F;
        const int high_bits = (high[32 * h + l] >> (2 * c)) & 0x03;
        const int code = (low_bits | (high_bits << 4)) - 32;
        y[position] = d * static_cast<float>(scale[position / 16]) * static_cast<float>(code);
      }
    }
  }
}

// The 4-bit part of value j of a block's 16 code bytes: j < 16 in the low nibble of byte j, else the high of j - 16.
inline int low_bits(const uint8_t* low, int j) { return j < 16 ? low[j] & 0x0F : low[j - 16] >> 4; }

// Q5_0: fp16 d, 32 high bits (value j's is bit j), 16 bytes of low 4 bits; value = d * (code - 16).

void q5_0(const uint8_t* block, float* y) {
  const float d = half(block);
  uint32_t high_bits;
  std::memcpy(&high_bits, block + 2, 4);
  for (int j = 0; j < 32; ++j) {
    const int code = (low_bits(block + 6, j) | static_cast<int>(((high_bits >> j) & 1) << 4)) - 16;
    y[j] = d * static_cast<float>(code);
  }
}

// Q4_0: fp16 d, 16 bytes of 4-bit codes (as Q5_0's low bits); value = d * (code - 8).
void q4_0(const uint8_t* block, float* y) {
  const float d = half(block);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(low_bits(block + 2, j) - 8);
}

// Q8_0: fp16 d, 32 int8 codes; value = d * code.
void q8_0(const uint8_t* block, float* y) {
  const float d = half(block);
  const int8_t* codes = reinterpret_cast<const int8_t*>(block + 2);
  for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(codes[j]);
}

void decode(int64_t type, const uint8_t* block, float* y) {
  switch (type) {
    case Q4_K: q4_k(block, y); break;
    case Q6_K: q6_k(block, y); break;
    case Q4_0: q4_0(block, y); break;
    case Q5_0: q5_0(block, y); break;
    case Q8_0: q8_0(block, y); break;
  }
}

// blocks: uint8 (rows, bytes per row); ids: int64 of any shape; float32 (*ids.shape, cols).
at::Tensor gguf_rows(const at::Tensor& blocks, const at::Tensor& ids, int64_t type, int64_t cols) {
  BlockFormat format;
  TORCH_CHECK(block_format(type, &format), "specchat::gguf_rows: GGML type ", type, " is not supported");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(), "specchat::gguf_rows: blocks must be contiguous uint8 (rows, row bytes)");
  TORCH_CHECK(cols % format.weights == 0 && blocks.size(1) == cols / format.weights * format.bytes,
              "specchat::gguf_rows: ", cols, " values do not fill the rows of ", blocks.size(1), " bytes");
  TORCH_CHECK(ids.device().is_cpu() && !at::isFloatingType(ids.scalar_type()) && ids.scalar_type() != at::kBool,
              "specchat::gguf_rows: ids must be an integer CPU tensor");
  const at::Tensor index = ids.to(at::kLong).contiguous();
  const int64_t* id = index.data_ptr<int64_t>();
  const int64_t count = index.numel(), rows = blocks.size(0), row_bytes = blocks.size(1);
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "specchat::gguf_rows: index ", id[i], " is out of range for ", rows,
                " rows");
  }
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(cols);
  at::Tensor out = at::empty(shape, blocks.options().dtype(at::kFloat));
  const uint8_t* data = blocks.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  const int64_t file = file_type(type);
  BlockFormat file_format;
  block_format(file, &file_format);
  const int64_t per_row = cols / file_format.weights;  // the file's blocks
  const int64_t tiled_rows = is_tiled(type) ? 16 : 1;  // a tiled row comes back with the 15 interleaved with it
  // a lookup is a few rows, one thread; every row of a tensor (its weights quantized again) takes them all
  at::parallel_for(0, count, 256, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> unpacked(is_packed(type) ? static_cast<size_t>(tiled_rows * per_row * file_format.bytes) : 0);
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* row = data + id[i] * row_bytes;
      if (is_tiled(type)) {  // the file's bytes back first
        unpack_tiles(type, data + id[i] / 16 * 16 * row_bytes, unpacked.data(), 16, cols / format.weights);
        row = unpacked.data() + id[i] % 16 * per_row * file_format.bytes;
      } else if (is_packed(type)) {
        unpack_blocks(type, row, unpacked.data(), cols / format.weights);
        row = unpacked.data();
      }
      for (int64_t b = 0; b < per_row; ++b) {
        decode(file, row + b * file_format.bytes, y + i * cols + b * file_format.weights);
      }
    }
  });
  return out;
}

// Q8_0 as ggml's reference quantizer (and gguf-py's) makes it: per 32 values d = max |x| / 127 in float32, codes
// round(x / d) half away from zero (through the float32 inverse), d stored as fp16.
void quantize_q8_0(const float* x, uint8_t* block) {
  float top = 0.0f;
  for (int j = 0; j < 32; ++j) top = std::max(top, std::fabs(x[j]));
  const float d = top / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
  const uint16_t bits = c10::Half(d).x;
  std::memcpy(block, &bits, 2);
  for (int j = 0; j < 32; ++j) block[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[j] * inverse)));
}

// Q4_0 as ggml's reference quantizer (and gguf-py's) makes it: per 32 values d = -m / 8 for the value m of largest
// magnitude, codes min(15, trunc(x / d + 8.5)) through the float32 inverse, d stored as fp16.
void quantize_q4_0(const float* x, uint8_t* block) {
  float top = 0.0f, extreme = 0.0f;
  for (int j = 0; j < 32; ++j) {
    if (std::fabs(x[j]) > top) top = std::fabs(x[j]), extreme = x[j];
  }
  const float d = extreme / -8.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
  const uint16_t bits = c10::Half(d).x;
  std::memcpy(block, &bits, 2);
  const auto code = [&](float v) { return std::min(15, static_cast<int>(static_cast<int8_t>(v * inverse + 8.5f))); };
  for (int j = 0; j < 16; ++j) block[2 + j] = static_cast<uint8_t>(code(x[j]) | code(x[16 + j]) << 4);
}

// w: float32 (rows, cols), cols a multiple of 32; uint8 (rows, cols / 32 * the type's block bytes).
at::Tensor gguf_quantize(const at::Tensor& w, int64_t type) {
  TORCH_CHECK(type == Q8_0 || type == Q4_0, "specchat::gguf_quantize: only Q8_0 (type 8) and Q4_0 (type 2) are made "
              "here, not type ", type);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(1) % 32 == 0,
              "specchat::gguf_quantize: w must be a 2-D float32 CPU tensor of whole blocks of 32 columns");
  const at::Tensor source = w.contiguous();
  BlockFormat format;
  block_format(type, &format);
  const int64_t rows = w.size(0), per_row = w.size(1) / 32, bytes = format.bytes;
  at::Tensor blocks = at::empty({rows, per_row * bytes}, w.options().dtype(at::kByte));
  const float* x = source.data_ptr<float>();
  uint8_t* out = blocks.data_ptr<uint8_t>();
  at::parallel_for(0, rows * per_row, 4096, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (type == Q8_0) quantize_q8_0(x + b * 32, out + b * bytes);
      else quantize_q4_0(x + b * 32, out + b * bytes);
    }
  });
  return blocks;
}

}  // namespace
}  // namespace specchat

TORCH_LIBRARY_FRAGMENT(specchat, m) {
  m.def("gguf_rows(Tensor blocks, Tensor ids, int ggml_type, int cols) -> Tensor");
  m.def("gguf_quantize(Tensor w, int ggml_type) -> Tensor");
}

TORCH_LIBRARY_IMPL(specchat, CPU, m) {
  m.impl("gguf_rows", &specchat::gguf_rows);
  m.impl("gguf_quantize", &specchat::gguf_quantize);
}
