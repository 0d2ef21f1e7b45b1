// The torch ops: specchat::gguf_mm (float32 rows times a GGUF tensor's blocks) and specchat::gguf_isa.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include <c10/util/StringUtil.h>

#include "blocks.h"
#include "lanes.h"

namespace specchat {
namespace {

constexpr int64_t kRowTile = 16;  // rows whose int8 activations stay in L2 while every weight block meets them

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool has_avx512_vnni() {
  __builtin_cpu_init();
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}

bool has_amx() { return has_avx512_vnni() && amx::available(); }

// The kernels this CPU runs, best first.
std::vector<const Kernels*> runnable() {
  std::vector<const Kernels*> all;
  if (has_amx()) all.push_back(&amx::kernels);
  if (has_avx512_vnni()) all.insert(all.end(), {&avx512_tiles::kernels, &avx512::kernels});
  if (has_avx2()) all.push_back(&avx2::kernels);
  return all;
}

// The best instruction set this CPU runs, unless gguf_use chose another it runs too.
std::atomic<const Kernels*>& chosen() {
  static std::atomic<const Kernels*> kernels{runnable().empty() ? nullptr : runnable().front()};
  return kernels;
}

// The kernels that read weights of this type: the chosen ones, or for a type they do not take the next set below them
// that does (the tile sets leave Q5_0 and Q8_0 to the lane set, which leaves the file's own layouts to AVX2).
const Kernels* reading(int64_t type, int64_t k) {
  const Kernels* order[] = {&amx::kernels, &avx512_tiles::kernels, &avx512::kernels, &avx2::kernels};
  bool below = false;
  for (const Kernels* kernels : order) {
    below = below || kernels == chosen().load();
    if (below && kernels->takes(type, k)) return kernels;
  }
  return nullptr;
}

// The best kernels this CPU runs that read this packed layout.
const char* packed_for(int64_t type, int64_t k) {
  for (const Kernels* kernels : runnable()) {
    if (kernels->takes(type, k)) return kernels->name;
  }
  return "another CPU's";  // no set this CPU runs reads it
}

std::string gguf_isa() {
  const Kernels* kernels = chosen().load();
  return kernels ? kernels->name : "";
}

// The kernels' instruction sets this CPU runs, best first.
std::vector<std::string> gguf_isas() {
  std::vector<std::string> names;
  for (const Kernels* kernels : runnable()) names.emplace_back(kernels->name);
  return names;
}

// How far ahead of the weights they read (bytes) the kernels ask for cache lines; 0: each layout's own distance. A
// property of the machine's memory more than of the code: timed where the kernels run (models/formats/prefetch.py).
std::atomic<int64_t>& ahead() {
  static std::atomic<int64_t> bytes{0};
  return bytes;
}

// Set the distance (bytes, 0 for each layout's own; below 0 leaves it); the distance now.
int64_t gguf_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes <= (int64_t{1} << 20), "specchat::gguf_prefetch: ", bytes, " bytes ahead is past any cache");
  if (bytes >= 0) ahead().store(bytes);
  return ahead().load();
}

// Run on the kernels of one instruction set from now on ("" for the best); the name in use.
std::string gguf_use(const std::string& isa) {
  const auto names = gguf_isas();
  const std::string name = isa.empty() && !names.empty() ? names.front() : isa;
  TORCH_CHECK(std::find(names.begin(), names.end(), name) != names.end(), "specchat::gguf_use: this CPU does not run ",
              isa, " kernels (it runs: ", c10::Join(", ", names), ")");
  for (const Kernels* kernels : runnable()) {
    if (name == kernels->name) chosen().store(kernels);
  }
  return gguf_isa();
}

at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t n_out,
                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(chosen().load(), "specchat::gguf_mm needs a CPU with AVX2 and FMA");
  const Kernels* kernels = reading(type, x.size(1));
  TORCH_CHECK(kernels, "specchat::gguf_mm: these weights were packed for the ", packed_for(type, x.size(1)), " kernels and the ",
              chosen().load()->name, " ones run now: pack them again");
  BlockFormat format;
  TORCH_CHECK(block_format(type, &format), "specchat::gguf_mm: GGML type ", type, " is not supported");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "specchat::gguf_mm: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
                  w.size(0) == n_out, "specchat::gguf_mm: w must be contiguous uint8 (out_features, row bytes)");
  TORCH_CHECK(n_out % kernels->columns == 0, "specchat::gguf_mm: the ", kernels->name, " kernels take whole ",
              kernels->columns, " output columns");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % format.weights == 0 && w.size(1) == k / format.weights * format.bytes,
              "specchat::gguf_mm: ", k, " inputs do not fill the rows of ", w.size(1), " bytes");
  const float* bias_data = nullptr;
  at::Tensor bias_tensor;
  if (bias.has_value()) {
    bias_tensor = bias->contiguous();
    TORCH_CHECK(bias_tensor.scalar_type() == at::kFloat && bias_tensor.numel() == n_out,
                "specchat::gguf_mm: bias must be float32 with out_features values");
    bias_data = bias_tensor.data_ptr<float>();
  }
  const at::Tensor input = x.contiguous();
  const int64_t group = 32;  // one activation scale per 32 values, for every format (docs/kernels.md: accuracy)
  // The rounded activations: only what the chosen kernels read, in this thread's scratch, kept between calls (a step
  // makes hundreds of them) up to a verify's size; a prefill's is freed after it.
  const int64_t plain = kernels->packed(type) ? 0 : rows;
  const int64_t q_bytes = plain * k, d_bytes = plain * (k / group) * 4, s_bytes = plain * (k / 16) * 2;
  constexpr size_t kKept = size_t{1} << 20;
  thread_local std::vector<int8_t> scratch;
  std::vector<int8_t> once;
  const size_t needed = static_cast<size_t>(q_bytes + d_bytes + s_bytes + (rows - plain) * 2 * k + 64);
  std::vector<int8_t>& buffer = needed <= kKept ? scratch : once;
  if (buffer.size() < needed) buffer.resize(needed);
  int8_t* base = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
  const Activations a{base + d_bytes + s_bytes, reinterpret_cast<const float*>(base),
                      reinterpret_cast<const int16_t*>(base + d_bytes), base + d_bytes + s_bytes + q_bytes, k, group,
                      2 * k, ahead().load(std::memory_order_relaxed)};
  at::Tensor out = at::empty({rows, n_out}, x.options());
  const float* x_data = input.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) { kernels->quantize(type, x_data, begin, end - begin, a); });
  const uint8_t* weights = w.data_ptr<uint8_t>();
  float* out_data = out.data_ptr<float>();
  for (int64_t row0 = 0; row0 < rows; row0 += kRowTile) {
    const int64_t count = std::min(kRowTile, rows - row0);
    const int64_t columns = kernels->columns;
    at::parallel_for(0, n_out / columns, std::max<int64_t>(1, 8 / columns), [&](int64_t n0, int64_t n1) {
      kernels->matmul(type, weights, w.size(1), a, row0, count, bias_data, out_data, n_out, n0 * columns,
                      n1 * columns);
    });
  }
  return out;
}

// The type the kernels in use read a file type's weights of k inputs in: the type itself, or its packed layout.
int64_t gguf_layout(int64_t type, int64_t k, int64_t n) {
  const Kernels* kernels = chosen().load();
  return kernels ? kernels->layout(type, k, n) : type;
}

// w's rows (uint8, rows x bytes) from one layout to another, each row a whole number of the packed layout's units;
// tiles move 16 rows at a time.
at::Tensor convert(const at::Tensor& w, int64_t from, int64_t to) {
  BlockFormat in, out;
  TORCH_CHECK(block_format(from, &in) && block_format(to, &out), "specchat: GGML type ", from, " is not supported");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.size(1) % in.bytes == 0,
              "specchat: blocks must be uint8 (rows, whole blocks of ", in.bytes, " bytes)");
  const int64_t k = w.size(1) / in.bytes * in.weights, unit = std::max(in.weights, out.weights);
  TORCH_CHECK(k % unit == 0, "specchat: rows of ", k, " weights are not whole units of ", unit);
  const int64_t group = is_tiled(from) || is_tiled(to) ? 16 : 1;
  TORCH_CHECK(w.size(0) % group == 0, "specchat: tiles take whole groups of 16 rows, not ", w.size(0));
  const at::Tensor source = w.contiguous();
  const int64_t units = k / unit, out_bytes = k / out.weights * out.bytes;
  at::Tensor result = at::empty({w.size(0), out_bytes}, w.options());
  const uint8_t* src = source.data_ptr<uint8_t>();
  uint8_t* dst = result.data_ptr<uint8_t>();
  at::parallel_for(0, w.size(0) / group, 64 / group, [&](int64_t g0, int64_t g1) {
    const int64_t row = g0 * group, rows = (g1 - g0) * group;
    const uint8_t* in_rows = src + row * w.size(1);
    uint8_t* out_rows = dst + row * out_bytes;
    if (is_tiled(to)) pack_tiles(from, in_rows, out_rows, rows, units);
    else if (is_tiled(from)) unpack_tiles(from, in_rows, out_rows, rows, units);
    else if (is_packed(to)) pack_blocks(from, in_rows, out_rows, rows * units);
    else unpack_blocks(from, in_rows, out_rows, rows * units);
  });
  return result;
}

// A file type's blocks (rows of k weights) in the layout the kernels in use read (gguf_layout), and back.
at::Tensor gguf_pack(const at::Tensor& w, int64_t type) {
  BlockFormat format;
  TORCH_CHECK(block_format(type, &format) && !is_packed(type), "specchat::gguf_pack: GGML type ", type,
              " is not a file type the kernels take");
  const int64_t to = gguf_layout(type, w.size(1) / format.bytes * format.weights, w.size(0));
  if (to == type) return w.clone();  // an op does not return its input
  return convert(w, type, to);
}

at::Tensor gguf_unpack(const at::Tensor& w, int64_t type) {
  if (!is_packed(type)) return w.clone();
  return convert(w, type, file_type(type));
}

}  // namespace
}  // namespace specchat

TORCH_LIBRARY(specchat, m) {
  m.def("gguf_mm(Tensor x, Tensor w, int ggml_type, int out_features, Tensor? bias=None) -> Tensor");
  m.def("gguf_isa() -> str", &specchat::gguf_isa);
  m.def("gguf_isas() -> str[]", &specchat::gguf_isas);
  m.def("gguf_use(str isa) -> str", &specchat::gguf_use);
  m.def("gguf_prefetch(int bytes) -> int", &specchat::gguf_prefetch);
  m.def("gguf_layout(int ggml_type, int k, int n) -> int", &specchat::gguf_layout);
  m.def("gguf_pack(Tensor w, int ggml_type) -> Tensor");
  m.def("gguf_unpack(Tensor w, int ggml_type) -> Tensor");
}

TORCH_LIBRARY_IMPL(specchat, CPU, m) {
  m.impl("gguf_mm", &specchat::gguf_mm);
  m.impl("gguf_pack", &specchat::gguf_pack);
  m.impl("gguf_unpack", &specchat::gguf_unpack);
}
