// aioengine's CPU kernels, float32:
// - paged decode attention: one query token per row, K and V read in place from the paged cache
//   through each row's block table (no gathered copy of the context);
// - argmax_rows: greedy sampling's argmax.
//
// Built on first use by aioengine/model/cpu_kernels.py (torch.utils.cpp_extension); the plain torch
// paths (attention.py, torch.argmax) compute the same things and are what these are tested against.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// q [B, H, D]; kv_cache [2, num_blocks, block_size, Hkv, D]; block_tables [B, W] int64;
// context_lens [B] int64 (row b attends to positions 0 .. context_lens[b]-1); out [B, H, D].
// Query head h reads KV head h / (H / Hkv), as HF's repeat_kv does.
void paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2 && context_lens.dim() == 1,
              "paged_decode_attention: q [B,H,D], kv_cache [2,N,bs,Hkv,D], block_tables [B,W], context_lens [B]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and context_lens must be int64");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes(),
              "paged_decode_attention: q, kv_cache and out must be contiguous, out shaped like q");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == D && Hkv > 0 && H % Hkv == 0,
              "paged_decode_attention: kv_cache does not match q's heads / head size");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "paged_decode_attention: one table row per query");
  const int64_t G = H / Hkv, W = block_tables.size(1);
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const int64_t* bt = tables.data_ptr<int64_t>();
  const int64_t* cl = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // checked here, not inside the parallel region
    TORCH_CHECK(cl[b] >= 1 && cl[b] <= W * bs, "paged_decode_attention: context length ", cl[b], " of row ", b,
                " outside 1..", W * bs);
    for (int64_t j = 0; j < (cl[b] + bs - 1) / bs; ++j) {
      TORCH_CHECK(bt[b * W + j] >= 0 && bt[b * W + j] < num_blocks, "paged_decode_attention: block id ",
                  bt[b * W + j], " of row ", b, " outside 0..", num_blocks - 1);
    }
  }
  const float* qp = q.data_ptr<float>();
  const float* kp = kv_cache.data_ptr<float>();
  const float* vp = kp + num_blocks * bs * Hkv * D;
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv, L = cl[b];
      const int64_t* table = bt + b * W;
      const float* qb = qp + (b * H + h * G) * D;
      scores.resize(G * L);
      for (int64_t t = 0; t < L; ++t) {
        const float* k = kp + ((table[t / bs] * bs + t % bs) * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qq = qb + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qq[d] * k[d];
          scores[g * L + t] = s * fscale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax over the row's context, max-subtracted
        float* sc = scores.data() + g * L;
        const float m = *std::max_element(sc, sc + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          sc[t] = std::exp(sc[t] - m);
          sum += sc[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sc[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const float* v = vp + ((table[t / bs] * bs + t % bs) * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * L + t];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
        }
      }
      std::copy(acc.begin(), acc.end(), op + (b * H + h * G) * D);
    }
  });
}

// Index of the first maximum of every row of x [B, V] float32 (greedy sampling), as int64 [B].
// torch.argmax walks each row with index bookkeeping that does not vectorise; this takes the row's
// max in a vectorisable pass, then finds its first occurrence. NaN entries are ignored.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "argmax_rows: x must be [B, V>0] float32");
  const at::Tensor xc = x.contiguous();
  const int64_t B = xc.size(0), V = xc.size(1);
  at::Tensor out = at::empty({B}, xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* row = xp + b * V;
      constexpr int64_t kLanes = 16;  // independent partial maxima: the loop compiles to packed max
      float lanes[kLanes];
      std::fill(lanes, lanes + kLanes, -std::numeric_limits<float>::infinity());
      int64_t i = 0;
      for (; i + kLanes <= V; i += kLanes) {
        for (int64_t j = 0; j < kLanes; ++j) lanes[j] = row[i + j] > lanes[j] ? row[i + j] : lanes[j];
      }
      float m = *std::max_element(lanes, lanes + kLanes);
      for (; i < V; ++i) m = row[i] > m ? row[i] : m;
      int64_t idx = 0;
      while (idx < V && !(row[idx] == m)) ++idx;
      op[b] = idx < V ? idx : 0;  // a row of NaN and -inf only: 0
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU, float32), in place into out");
  m.def("argmax_rows", &argmax_rows, "First index of each row's maximum (CPU, float32)");
}
