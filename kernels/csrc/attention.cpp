// specchat::row_attention: attention computed one query row at a time over exactly the keys that row sees, in key
// order, by one thread: a row's result has the same bits whatever the rows beside it, the masked-out tail and the
// threads. The row-by-row attention of models/row_attention.py, without its Python loop.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace specchat {
namespace {

// Every step below is the same for a row whatever the rows beside it: its keys' count alone sets the chunks.

// The 8 lanes' sum, in a fixed order.
float lane_sum(__m256 x) {
  float lanes[8];
  _mm256_storeu_ps(lanes, x);
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

// q . k over n values: two 8-wide chains (values 16 i.. and 16 i + 8..), added, their lanes summed by lane_sum.
float dot(const float* a, const float* b, int64_t n) {
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    low = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), low);
    high = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), high);
  }
  for (; i + 8 <= n; i += 8) low = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), low);
  float sum = lane_sum(_mm256_add_ps(low, high));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// out[j] = dot(q, keys[j], n) for 4 keys at once, by the same steps (n a multiple of 16): eight chains in flight
// instead of two, and the four keys' lanes summed together in lane_sum's order.
void dot4(const float* q, const float* const* keys, int64_t n, float* out) {
  __m256 low[4], high[4];
  for (int j = 0; j < 4; ++j) low[j] = high[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m256 x = _mm256_loadu_ps(q + i), y = _mm256_loadu_ps(q + i + 8);
    for (int j = 0; j < 4; ++j) {
      low[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys[j] + i), low[j]);
      high[j] = _mm256_fmadd_ps(y, _mm256_loadu_ps(keys[j] + i + 8), high[j]);
    }
  }
  __m256 sums[4];
  for (int j = 0; j < 4; ++j) sums[j] = _mm256_add_ps(low[j], high[j]);
  // lanes l + (l + 4): keys 0 and 1, then 2 and 3, each key in one 128-bit half
  const __m256 first = _mm256_add_ps(_mm256_permute2f128_ps(sums[0], sums[1], 0x20),
                                     _mm256_permute2f128_ps(sums[0], sums[1], 0x31));
  const __m256 second = _mm256_add_ps(_mm256_permute2f128_ps(sums[2], sums[3], 0x20),
                                      _mm256_permute2f128_ps(sums[2], sums[3], 0x31));
  // (0 + 4) + (1 + 5) and (2 + 6) + (3 + 7), then their sum: keys 0, 2 in the low half, 1, 3 in the high
  const __m256 pairs = _mm256_hadd_ps(first, second);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_hadd_ps(pairs, pairs));
  out[0] = lanes[0];
  out[1] = lanes[4];
  out[2] = lanes[1];
  out[3] = lanes[5];
}

// exp for x <= 0 (a score less the row's largest), Cephes' polynomial: within 2 ulp of exp, and below
// -87.3 (where exp underflows) exp(-87.3).
__m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(power));
}

// w[0..count) = softmax(w): exps of the scores less their largest, over their sum (8 partial sums, then in order).
void softmax(float* w, int64_t count) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t n = 0; n < count; ++n) top = std::max(top, w[n]);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 sums = _mm256_setzero_ps();
  int64_t n = 0;
  for (; n + 8 <= count; n += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(w + n), shift));
    _mm256_storeu_ps(w + n, e);
    sums = _mm256_add_ps(sums, e);
  }
  float total = lane_sum(sums);
  if (n < count) {  // the last few through the same function, padded
    float tail[8];
    for (int64_t j = 0; j < 8; ++j) tail[j] = n + j < count ? w[n + j] - top : 0.0f;
    _mm256_storeu_ps(tail, exp_nonpositive(_mm256_loadu_ps(tail)));
    for (int64_t j = 0; n + j < count; ++j) total += (w[n + j] = tail[j]);
  }
  const __m256 scale = _mm256_set1_ps(1.0f / total);
  for (n = 0; n + 8 <= count; n += 8) _mm256_storeu_ps(w + n, _mm256_mul_ps(_mm256_loadu_ps(w + n), scale));
  for (; n < count; ++n) w[n] *= 1.0f / total;
}

// out[0..n) += sum over j < count of w[j] * rows[j][0..n), in j order for each element (the same steps as adding
// the rows one after another); 64 columns at a time in registers, so `out` is loaded and stored once per call.
void add_weighted_rows(float* out, const float* w, const float* const* rows, int64_t count, int64_t n) {
  int64_t c = 0;
  for (; c + 64 <= n; c += 64) {
    __m256 sums[8];
    for (int64_t l = 0; l < 8; ++l) sums[l] = _mm256_loadu_ps(out + c + 8 * l);
    for (int64_t j = 0; j < count; ++j) {
      const __m256 weight = _mm256_set1_ps(w[j]);
      const float* v = rows[j] + c;
      for (int64_t l = 0; l < 8; ++l) sums[l] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * l), sums[l]);
    }
    for (int64_t l = 0; l < 8; ++l) _mm256_storeu_ps(out + c + 8 * l, sums[l]);
  }
  for (; c + 8 <= n; c += 8) {
    __m256 sum = _mm256_loadu_ps(out + c);
    for (int64_t j = 0; j < count; ++j) sum = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(rows[j] + c), sum);
    _mm256_storeu_ps(out + c, sum);
  }
  for (; c < n; ++c)
    for (int64_t j = 0; j < count; ++j) out[c] += w[j] * rows[j][c];
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
      int64_t n = 0;
      if (width % 16 == 0) {  // key rows 4 at a time (from L1 for every head of the unit)
        const float* block4[4];
        float scores[4];
        for (; n + 4 <= count; n += 4) {
          for (int j = 0; j < 4; ++j) block4[j] = kh + keys[n + j] * width;
          for (int64_t h = 0; h < per_unit; ++h) {
            dot4(qd + ((b * heads + first + h) * rows + i) * width, block4, width, scores);
            for (int j = 0; j < 4; ++j) weights[h * length + n + j] = scores[j] * scale;
          }
        }
      }
      for (; n < count; ++n) {  // the rest one key at a time, by the same steps
        const float* kj = kh + keys[n] * width;
        for (int64_t h = 0; h < per_unit; ++h)
          weights[h * length + n] = dot(qd + ((b * heads + first + h) * rows + i) * width, kj, width) * scale;
      }
      for (int64_t h = 0; h < per_unit; ++h) softmax(weights.data() + h * length, count);
      constexpr int64_t kBlock = 64;  // value rows per block: 32 KB of a 128-wide head, read from L1 by every head
      const float* block[kBlock];
      for (int64_t n = 0; n < count; n += kBlock) {
        const int64_t size = std::min(kBlock, count - n);
        for (int64_t j = 0; j < size; ++j) block[j] = vh + keys[n + j] * value_width;
        for (int64_t h = 0; h < per_unit; ++h)
          add_weighted_rows(oi + h * value_width, weights.data() + h * length + n, block, size, value_width);
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
