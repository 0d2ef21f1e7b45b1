// specchat::row_attention: attention computed one query row at a time over exactly the keys that row sees, in key
// order, by one thread: a row's result has the same bits whatever the rows beside it, the masked-out tail and the
// threads. The row-by-row attention of models/row_attention.py, without its Python loop.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace specchat {
namespace {

constexpr int64_t kWidth = 16;  // partial sums of a dot product, added in a fixed order

float dot(const float* a, const float* b, int64_t n) {
  float lanes[kWidth] = {};
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth)
    for (int64_t l = 0; l < kWidth; ++l) lanes[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) lanes[i % kWidth] += a[i] * b[i];
  for (int64_t step = kWidth / 2; step > 0; step /= 2)
    for (int64_t l = 0; l < step; ++l) lanes[l] += lanes[l + step];
  return lanes[0];
}

// q (B, H, Q, D), k and v (B, Hkv, K, D) float32; seen: None (causal: row i sees keys 0..K - Q + i) or bool
// (B or 1, Q, K). Returns (B, Q, H, Dv).
at::Tensor row_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const c10::optional<at::Tensor>& seen, double scaling) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "specchat::row_attention: 4-D q, k, v");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat
                  && query.device().is_cpu(), "specchat::row_attention: float32 CPU tensors");
  const at::Tensor q = query.contiguous();
  // a cache's keys and values may be a view of a longer buffer: read them in place where each token's row is whole
  const auto rows_whole = [](const at::Tensor& t) { return t.stride(3) == 1 && t.stride(2) == t.size(3); };
  const at::Tensor k = rows_whole(key) ? key : key.contiguous(), v = rows_whole(value) ? value : value.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2), width = q.size(3);
  const int64_t key_heads = k.size(1), length = k.size(2), value_width = v.size(3);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch && v.size(1) == key_heads && v.size(2) == length &&
                  k.size(3) == width && key_heads > 0 && heads % key_heads == 0 && rows <= length,
                  "specchat::row_attention: q, k, v shapes do not fit");
  at::Tensor mask;
  if (seen.has_value()) {
    mask = seen->to(at::kBool).contiguous();
    TORCH_CHECK(mask.dim() == 3 && (mask.size(0) == 1 || mask.size(0) == batch) && mask.size(1) == rows &&
                    mask.size(2) == length, "specchat::row_attention: seen must be (B or 1, Q, K) bool");
  }
  at::Tensor out = at::empty({batch, rows, heads, value_width}, q.options());
  const float* qd = q.data_ptr<float>();
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  const bool* md = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  float* od = out.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  const int64_t group = heads / key_heads;
  // A unit is one row's query heads that share a key head (a split of them where rows are too few to keep every
  // thread busy): each key and value row is read once for all of them. Each head's arithmetic is the same whatever
  // the split, so the bits do not depend on it.
  const int64_t threads = at::get_num_threads();
  int64_t split = 1;
  while (split < group && batch * key_heads * rows * split < threads) ++split;
  while (group % split) ++split;
  const int64_t per_unit = group / split;
  at::parallel_for(0, batch * key_heads * rows * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(static_cast<size_t>(length * per_unit));
    std::vector<int64_t> keys(static_cast<size_t>(length));
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t part = unit % split, i = unit / split % rows, g = unit / (split * rows) % key_heads;
      const int64_t b = unit / (split * rows * key_heads), first = g * group + part * per_unit;
      const float* kh = kd + b * k.stride(0) + g * k.stride(1);
      const float* vh = vd + b * v.stride(0) + g * v.stride(1);
      int64_t count = 0;
      if (md) {
        const bool* row = md + ((mask.size(0) == 1 ? 0 : b) * rows + i) * length;
        for (int64_t j = 0; j < length; ++j)
          if (row[j]) keys[count++] = j;
      } else {
        for (int64_t j = 0; j <= length - rows + i; ++j) keys[count++] = j;
      }
      float* oi = od + ((b * rows + i) * heads + first) * value_width;  // this unit's heads are adjacent
      for (int64_t c = 0; c < per_unit * value_width; ++c) oi[c] = 0.0f;
      if (count == 0) continue;
      for (int64_t n = 0; n < count; ++n) {  // key row n once, for every head of the unit
        const float* kj = kh + keys[n] * width;
        for (int64_t h = 0; h < per_unit; ++h)
          weights[h * length + n] = dot(qd + ((b * heads + first + h) * rows + i) * width, kj, width) * scale;
      }
      std::vector<float> totals(static_cast<size_t>(per_unit));
      for (int64_t h = 0; h < per_unit; ++h) {
        float* w = weights.data() + h * length;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t n = 0; n < count; ++n) top = std::max(top, w[n]);
        float total = 0.0f;
        for (int64_t n = 0; n < count; ++n) {
          w[n] = std::exp(w[n] - top);
          total += w[n];
        }
        totals[h] = total;
      }
      for (int64_t n = 0; n < count; ++n) {  // value row n once, for every head of the unit
        const float* vj = vh + keys[n] * value_width;
        for (int64_t h = 0; h < per_unit; ++h) {
          const float w = weights[h * length + n] / totals[h];
          float* oh = oi + h * value_width;
          for (int64_t c = 0; c < value_width; ++c) oh[c] += w * vj[c];
        }
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace specchat

TORCH_LIBRARY_FRAGMENT(specchat, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor? seen, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(specchat, CPU, m) { m.impl("row_attention", &specchat::row_attention); }
