// aioengine's CPU kernels, float32:
// - paged decode attention: one query token per row, K and V read in place from the paged cache
//   through each row's block table (no gathered copy of the context);
// - argmax_rows: greedy sampling's argmax;
// - rms_norm, rotary_inplace, silu_and_mul: the elementwise parts of a Llama layer, one pass each
//   instead of 5-12 torch ops (on CPU every op costs microseconds of dispatch);
// - pack_rows: a swapped-in linear weight written into its oneDNN-reordered copy in place;
// - linear_row_blocks: x @ W.T (+ bias) read straight from that copy, for the few rows of a decode step
//   (AVX-512 builds only), and row_blocks_equal, which checks that a copy is laid out as it assumes;
// - paged prefill attention: one prompt chunk, causal, over its context in the paged cache (AVX-512 builds).
//
// Built on first use by aioengine/model/cpu_kernels.py (torch.utils.cpp_extension); the plain torch
// paths (attention.py, layers.py, torch.argmax) compute the same things and are what these are tested
// against.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Eight floats as one value (GCC/Clang vector extensions): AVX registers on x86, pairs of NEON
// registers on Arm. Loads and stores go through memcpy, so no pointer needs to be aligned.
typedef float vec8 __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof(v)); }

inline float sum8(vec8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

// out[0..3] = the sums of a0..a3.
inline void sum8x4(vec8 a0, vec8 a1, vec8 a2, vec8 a3, float* out) {
#if defined(__AVX__)
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a0, (__m256)a1), _mm256_hadd_ps((__m256)a2, (__m256)a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  out[0] = sum8(a0);
  out[1] = sum8(a1);
  out[2] = sum8(a2);
  out[3] = sum8(a3);
#endif
}

inline float exp_approx(float x);

// One query head against one block of keys: s[t] = scale * q . k_t for t < n, key t at k + t * stride.
// kD is the head size when known at compile time (the loops then unroll), 0 to take D at run time.
template <int64_t kD>
void block_scores(const float* q, const float* k, int64_t stride, int64_t n, int64_t D, float scale, float* s) {
  if (kD) D = kD;
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {  // four keys at once: q is loaded once for them, and summed in one go
    vec8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    const float* k0 = k + t * stride;
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
      const vec8 qq = load8(q + d);
      a0 += qq * load8(k0 + d);
      a1 += qq * load8(k0 + stride + d);
      a2 += qq * load8(k0 + 2 * stride + d);
      a3 += qq * load8(k0 + 3 * stride + d);
    }
    sum8x4(a0, a1, a2, a3, s + t);
    for (; d < D; ++d) {
      for (int64_t i = 0; i < 4; ++i) s[t + i] += q[d] * k0[i * stride + d];
    }
  }
  for (; t < n; ++t) {
    const float* kt = k + t * stride;
    vec8 a = {};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) a += load8(q + d) * load8(kt + d);
    float sum = sum8(a);
    for (; d < D; ++d) sum += q[d] * kt[d];
    s[t] = sum;
  }
  for (t = 0; t < n; ++t) s[t] *= scale;
}

// acc = acc * c + sum over t < n of p[t] * v_t, value t at v + t * stride; acc stays in registers.
template <int64_t kD>
void block_values(float* acc, float c, const float* p, const float* v, int64_t stride, int64_t n, int64_t D) {
  if (kD) {
    vec8 a[kD / 8];
    for (int64_t i = 0; i < kD / 8; ++i) a[i] = load8(acc + 8 * i) * c;
    for (int64_t t = 0; t < n; ++t) {
      const float w = p[t];
      const float* vt = v + t * stride;
      for (int64_t i = 0; i < kD / 8; ++i) a[i] += load8(vt + 8 * i) * w;
    }
    for (int64_t i = 0; i < kD / 8; ++i) store8(acc + 8 * i, a[i]);
    return;
  }
  for (int64_t d = 0; d < D; ++d) acc[d] *= c;
  for (int64_t t = 0; t < n; ++t) {
    const float w = p[t];
    const float* vt = v + t * stride;
    for (int64_t d = 0; d < D; ++d) acc[d] += w * vt[d];
  }
}

// q [B, H, D]; kv_cache [2, num_blocks, block_size, Hkv, D]; block_tables [B, W] int64;
// context_lens [B] int64 (row b attends to positions 0 .. context_lens[b]-1); out [B, H, D].
// Query head h reads KV head h / (H / Hkv), as HF's repeat_kv does.
//
// Decode attention reads every row's whole context from memory, so at large batches its cost is
// memory traffic. A task is one row and a run of its KV heads (all of them when there are rows
// enough to keep every thread busy), walking the row's blocks once: each block's keys and values
// are read once, for every query head of the task, in the cache's own order (whole token rows when
// the task has every head). The softmax is taken online, a running maximum and sum per head with
// the values accumulated so far rescaled when the maximum grows, so nothing the size of the context
// is stored.
template <int64_t kD>
void paged_decode_attention_impl(const float* qp, const float* kp, const float* vp, const int64_t* bt,
                                 const int64_t* cl, float* op, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                                 int64_t bs, int64_t W, float scale) {
  const int64_t G = H / Hkv, token_stride = Hkv * D;
  const int64_t heads_per_task = B >= 4 * at::get_num_threads() ? Hkv : 1;
  const int64_t tasks_per_row = Hkv / heads_per_task;
  at::parallel_for(0, B * tasks_per_row, 1, [&](int64_t begin, int64_t end) {
    const int64_t hq_count = heads_per_task * G;
    std::vector<float> scores(hq_count * bs), running_max(hq_count), running_sum(hq_count), acc(hq_count * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_row, h0 = (task % tasks_per_row) * heads_per_task, L = cl[b];
      const int64_t* table = bt + b * W;
      const float* qb = qp + (b * H + h0 * G) * D;  // the task's query heads, hq_count of them
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(running_sum.begin(), running_sum.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j * bs < L; ++j) {
        const int64_t n = std::min(bs, L - j * bs);
        const int64_t base = table[j] * bs * token_stride + h0 * D;
        for (int64_t hq = 0; hq < hq_count; ++hq) {
          const int64_t kv_offset = base + (hq / G) * D;
          float* s = scores.data() + hq * bs;
          block_scores<kD>(qb + hq * D, kp + kv_offset, token_stride, n, D, scale, s);
          const float m = std::max(running_max[hq], *std::max_element(s, s + n));
          float sum = 0.f;
          for (int64_t t = 0; t < n; ++t) {
            s[t] = exp_approx(s[t] - m);
            sum += s[t];
          }
          const float correction = exp_approx(running_max[hq] - m);  // 0 on the first block
          running_sum[hq] = running_sum[hq] * correction + sum;
          running_max[hq] = m;
          block_values<kD>(acc.data() + hq * D, correction, s, vp + kv_offset, token_stride, n, D);
        }
      }
      float* ob = op + (b * H + h0 * G) * D;
      for (int64_t hq = 0; hq < hq_count; ++hq) {
        const float inv = 1.f / running_sum[hq];
        for (int64_t d = 0; d < D; ++d) ob[hq * D + d] = acc[hq * D + d] * inv;
      }
    }
  });
}

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
  const int64_t W = block_tables.size(1);
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
  const float* kp = kv_cache.data_ptr<float>();
  const float* vp = kp + num_blocks * bs * Hkv * D;
  const auto run = D == 64 ? paged_decode_attention_impl<64>
                   : D == 128 ? paged_decode_attention_impl<128>
                              : paged_decode_attention_impl<0>;
  run(q.data_ptr<float>(), kp, vp, bt, cl, out.data_ptr<float>(), B, H, Hkv, D, bs, W, static_cast<float>(scale));
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

// One row of RMSNorm, as HF computes it in float32: out = weight * (h * rsqrt(mean(h^2) + eps)), given
// ss = sum(h^2).
inline void write_normed(const float* h, const float* w, float* out, int64_t D, float ss, float eps) {
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t d = 0; d < D; ++d) out[d] = w[d] * (h[d] * inv);
}

// RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  const int64_t D = weight.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == D && weight.is_contiguous(), "rms_norm: x's last dim must match weight");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t rows = xc.numel() / D;
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * D;
      float ss = 0.f;
      for (int64_t d = 0; d < D; ++d) ss += xr[d] * xr[d];
      write_normed(xr, wp, op + r * D, D, ss, feps);
    }
  });
  return out;
}

// The residual add fused into the RMSNorm after it: residual += x (in place), returns rms_norm(residual).
// One pass over both instead of an add that writes a new tensor and a norm that reads it back.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat,
              "add_rms_norm: float32 only");
  const int64_t D = weight.numel();
  TORCH_CHECK(x.sizes() == residual.sizes() && x.size(-1) == D && weight.is_contiguous() && residual.is_contiguous(),
              "add_rms_norm: x and residual must have the same shape, last dim matching weight, residual contiguous");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t rows = xc.numel() / D;
  const float* xp = xc.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * D;
      float* rr = rp + r * D;
      float ss = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const float h = rr[d] + xr[d];
        rr[d] = h;
        ss += h * h;
      }
      write_normed(rr, wp, op + r * D, D, ss, feps);
    }
  });
  return out;
}

// Rotate-half rotary embedding in place on q [T, Hq, D] and k [T, Hk, D] (last dim contiguous, any
// token/head strides: they may be views into the fused qkv output), from cos/sin tables [P, D].
void rotary_inplace(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat, "rotary_inplace: float32 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
              q.stride(2) == 1 && k.stride(2) == 1, "rotary_inplace: q, k must be [T, H, D] with D contiguous");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes() && cos.is_contiguous() &&
              sin.is_contiguous(), "rotary_inplace: cos/sin must be contiguous [positions, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == T, "rotary_inplace: one int64 position per token");
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "rotary_inplace: position ", pp[t], " outside the table");
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  auto rotate = [&](at::Tensor& x, int64_t t) {
    float* base = x.data_ptr<float>() + t * x.stride(0);
    const float* c = cp + pp[t] * D;
    const float* s = sp + pp[t] * D;
    for (int64_t h = 0; h < x.size(1); ++h) {
      float* v = base + h * x.stride(1);
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] + (-b) * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  };
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate(q, t);
      rotate(k, t);
    }
  });
}

// exp(x) for float32 as Cephes computes it (range reduction by ln 2, degree-6 polynomial, 2^n from
// the exponent bits): within 2 ulp of std::exp, and plain arithmetic, so loops over it vectorise.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// SwiGLU's activation: x [T, 2I] -> silu(x[:, :I]) * x[:, I:] as [T, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2I] float32");
  const at::Tensor xc = x.contiguous();
  const int64_t T = xc.size(0), I = xc.size(1) / 2;
  at::Tensor out = at::empty({T, I}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
    }
  });
  return out;
}

#if defined(__AVX__)
// out[k * ld_out + j] = in[j * ld_in + k] for an 8x8 tile, transposed in registers.
inline void transpose8x8(const float* in, int64_t ld_in, float* out, int64_t ld_out) {
  __m256 a[8], b[8], c[8];
  for (int r = 0; r < 8; ++r) a[r] = _mm256_loadu_ps(in + r * ld_in);
  for (int r = 0; r < 8; r += 2) {
    b[r] = _mm256_unpacklo_ps(a[r], a[r + 1]);
    b[r + 1] = _mm256_unpackhi_ps(a[r], a[r + 1]);
  }
  for (int r = 0; r < 8; r += 4) {
    c[r] = _mm256_shuffle_ps(b[r], b[r + 2], 0x44);
    c[r + 1] = _mm256_shuffle_ps(b[r], b[r + 2], 0xEE);
    c[r + 2] = _mm256_shuffle_ps(b[r + 1], b[r + 3], 0x44);
    c[r + 3] = _mm256_shuffle_ps(b[r + 1], b[r + 3], 0xEE);
  }
  for (int r = 0; r < 4; ++r) {
    _mm256_storeu_ps(out + r * ld_out, _mm256_permute2f128_ps(c[r], c[r + 4], 0x20));
    _mm256_storeu_ps(out + (r + 4) * ld_out, _mm256_permute2f128_ps(c[r], c[r + 4], 0x31));
  }
}
#endif

#if defined(__AVX512F__)
// Columns i .. i+7 of a 16-row strip (in [r * ld_in + i], r < 16) as whole 64-byte lines at out + c * ld_out,
// stored past the caches; out must be 64-byte aligned, ld_out a multiple of 16.
inline void store_columns16(const float* in, int64_t ld_in, float* out, int64_t ld_out) {
  alignas(64) float top[64], bottom[64];
  transpose8x8(in, ld_in, top, 8);
  transpose8x8(in + 8 * ld_in, ld_in, bottom, 8);
  for (int c = 0; c < 8; ++c) {
    const __m512 line = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(top + 8 * c)),
                                           _mm256_load_ps(bottom + 8 * c), 1);
    _mm512_stream_ps(out + c * ld_out, line);
  }
}
#endif

// dst[0, n) = src[0, n); the 64-byte aligned middle of dst is stored past the caches where AVX-512 is built.
inline void copy_past_caches(float* dst, const float* src, int64_t n) {
#if defined(__AVX512F__)
  int64_t i = 0;
  for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % 64 != 0; ++i) dst[i] = src[i];
  for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = src[i];
#else
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
#endif
}

// Rows [row_offset, row_offset + R) of a linear weight, given as src [R, I], written into a
// oneDNN-reordered copy of the weight in place (and, with `plain` defined, into the plain weight's rows
// too, in the same pass: src is read once). The layout is the one oneDNN picks for float32 matmul
// weights here: rows in blocks of `block`, each block stored column by column, so element (o, i) is at
// (o / block) * block_stride + i * block + o % block; the padding past the last row and column is left
// as it is (zeros from oneDNN's reorder). `dst_address` is the copy's data (torch.ops.mkldnn.data_ptr),
// `dst_floats` its size. A fresh reorder allocates the copy anew, and on this kind of host the first
// touch of fresh memory costs more than the reorder itself; in place, a swap writes memory already mapped.
// Where AVX-512 is built and the copy starts on a cache line, strips are 16 rows high and every column of
// a strip is one whole 64-byte line, stored past the caches; so is the plain weight's aligned middle.
void pack_rows(const at::Tensor& src, int64_t row_offset, int64_t dst_address, int64_t dst_floats, int64_t block,
               int64_t block_stride, const c10::optional<at::Tensor>& plain) {
  TORCH_CHECK(src.dim() == 2 && src.scalar_type() == at::kFloat && src.is_contiguous(),
              "pack_rows: src must be a contiguous [rows, I] float32 tensor");
  const int64_t R = src.size(0), I = src.size(1);
  TORCH_CHECK(dst_address != 0 && row_offset >= 0 && block > 0 && block % 8 == 0 && block_stride >= I * block,
              "pack_rows: the layout's block must be a positive multiple of 8 and its stride hold I columns");
  const int64_t blocks = (row_offset + R + block - 1) / block;
  TORCH_CHECK(blocks * block_stride <= dst_floats, "pack_rows: the layout needs ", blocks * block_stride,
              " floats, the destination holds ", dst_floats);
  float* plain_rows = nullptr;
  if (plain.has_value()) {
    TORCH_CHECK(plain->scalar_type() == at::kFloat && plain->is_contiguous() && plain->sizes() == src.sizes() &&
                    plain->data_ptr<float>() != src.data_ptr<float>(),
                "pack_rows: plain must be a contiguous float32 tensor shaped like src, not src itself");
    plain_rows = plain->data_ptr<float>();
  }
  float* dst = reinterpret_cast<float*>(dst_address);
  const float* in = src.data_ptr<float>();
  auto at_row = [&](int64_t o) { return dst + (o / block) * block_stride + o % block; };  // o: a weight row
#if defined(__AVX512F__)
  // A swap writes far more than the caches hold, and a store of part of a line first reads the line in:
  // streamed whole lines skip that read (about 20% of the write here).
  const bool whole_lines = block % 16 == 0 && block_stride % 16 == 0 && dst_address % 64 == 0;
#else
  const bool whole_lines = false;
#endif
  const int64_t strip_rows = whole_lines ? 16 : 8;
  // Strips aligned to their height (so none crosses a block); a partial strip at either end.
  const int64_t first = row_offset / strip_rows, last = (row_offset + R + strip_rows - 1) / strip_rows;
  at::parallel_for(first, last, 64 / strip_rows, [&](int64_t begin, int64_t end) {
    for (int64_t strip = begin; strip < end; ++strip) {
      const int64_t o0 = std::max(strip * strip_rows, row_offset);
      const int64_t o1 = std::min((strip + 1) * strip_rows, row_offset + R);
      const float* rows = in + (o0 - row_offset) * I;
      int64_t i0 = 0;
#if defined(__AVX512F__)
      if (whole_lines && o1 - o0 == 16) {
        float* out = at_row(o0);
        for (; i0 + 8 <= I; i0 += 8) store_columns16(rows + i0, I, out + i0 * block, block);
      }
#endif
#if defined(__AVX__)
      if (!whole_lines && o1 - o0 == 8) {
        float* out = at_row(o0);
        for (; i0 + 8 <= I; i0 += 8) transpose8x8(rows + i0, I, out + i0 * block, block);
      }
#endif
      for (int64_t o = o0; o < o1; ++o) {  // what the tiles left: partial strips, the last columns
        float* out = at_row(o);
        const float* row = rows + (o - o0) * I;
        for (int64_t i = i0; i < I; ++i) out[i * block] = row[i];
      }
      if (plain_rows != nullptr) {  // the strip's rows are in cache now
        copy_past_caches(plain_rows + (o0 - row_offset) * I, rows, (o1 - o0) * I);
      }
    }
#if defined(__AVX512F__)
    _mm_sfence();  // the streamed stores are weakly ordered: done before anyone reads the copy
#endif
  });
}

// Whether rows [0, R) of src [R, I] sit in the copy at dst_address under pack_rows' layout (block,
// block_stride), value for value: what linear_row_blocks needs of a copy before it reads one.
bool row_blocks_equal(const at::Tensor& src, int64_t dst_address, int64_t dst_floats, int64_t block,
                      int64_t block_stride) {
  TORCH_CHECK(src.dim() == 2 && src.scalar_type() == at::kFloat && src.is_contiguous(),
              "row_blocks_equal: src must be a contiguous [rows, I] float32 tensor");
  const int64_t R = src.size(0), I = src.size(1);
  TORCH_CHECK(dst_address != 0 && block > 0 && block_stride >= I * block,
              "row_blocks_equal: the layout's block must be positive and its stride hold I columns");
  const int64_t blocks = (R + block - 1) / block;
  if (blocks * block_stride > dst_floats) return false;
  const float* dst = reinterpret_cast<const float*>(dst_address);
  const float* in = src.data_ptr<float>();
  std::vector<char> equal(static_cast<size_t>(blocks), 1);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* packed = dst + b * block_stride;
      const int64_t rows = std::min(block, R - b * block);
      for (int64_t r = 0; r < rows && equal[b]; ++r) {  // bitwise, so a NaN weight matches its own copy
        const float* row = in + (b * block + r) * I;
        for (int64_t i = 0; i < I; ++i) {
          if (std::memcmp(row + i, packed + i * block + r, sizeof(float)) != 0) {
            equal[b] = 0;
            break;
          }
        }
      }
    }
  });
  return std::all_of(equal.begin(), equal.end(), [](char e) { return e != 0; });
}

#if defined(__AVX512F__)
constexpr int64_t kGemmBlock = 64;  // the copy's row block: 64 output columns, four AVX-512 registers

// out[r, c] = x[r, :] . W[c, :] (+ bias[c]) for MR rows of x and the ncols (<= 16 * NV) columns of one
// row block, whose column k holds W[c0 .. c0 + 63, k] at w + k * 64. MR x NV accumulators stay in
// registers over the whole of K (6 x 4 = 24 of the 32): each step loads NV vectors of W, broadcasts
// MR values of x and issues MR * NV fused multiply-adds; and `lines` cache lines from `prefetch` on are
// fetched into L2 over the steps of K (none when 0).
template <int MR, int NV>
void gemm_tile(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K, float* __restrict out,
               int64_t ldo, int64_t ncols, const float* __restrict bias, const float* prefetch, int64_t lines) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t every = lines > 0 ? std::max<int64_t>(1, K / lines) : K + 1;
  int64_t issued = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (k % every == 0 && issued < lines) __builtin_prefetch(prefetch + 16 * issued++, 0, 2);
    __m512 wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_ps(w + k * kGemmBlock + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xr, wv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const int64_t c = ncols - 16 * v;  // columns of this vector that exist (the block's last may be partial)
    if (c <= 0) break;
    const __mmask16 mask = c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << c) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + 16 * v) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo + 16 * v, mask, _mm512_add_ps(acc[r][v], b));
  }
}

using GemmTile = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*,
                          const float*, int64_t);
constexpr int kTileRows = 6;

template <int... R>
constexpr std::array<GemmTile, sizeof...(R)> gemm_tiles(std::integer_sequence<int, R...>) {
  return {&gemm_tile<R + 1, 4>...};
}
constexpr auto kGemmTiles = gemm_tiles(std::make_integer_sequence<int, kTileRows>{});

// x [M, K] @ W.T (+ bias) with W [N, K] read from its oneDNN-reordered copy in the row-block layout of
// pack_rows with a block of 64 (what oneDNN picks here for batches of 64 rows or more; the caller checks
// with row_blocks_equal). For few rows oneDNN's GEMM reaches 50-75% of this CPU's peak; this one keeps
// a 6 x 64 tile of the output in registers for the whole of K, reads each row block of W once from
// memory and then from L2 for the other row tiles, and splits the rows into tiles of near-equal size.
// From 24 rows on, each tile also prefetches a share of the thread's next block into L2, so that block's
// first tile does not wait on memory (at 64 rows 9-13% faster here, none lost at 512).
at::Tensor linear_row_blocks(const at::Tensor& x, int64_t w_address, int64_t w_floats, int64_t N,
                             int64_t block_stride, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.device().is_cpu(),
              "linear_row_blocks: x must be a [rows, K] float32 CPU tensor with unit column stride");
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  const int64_t blocks = (N + kGemmBlock - 1) / kGemmBlock;
  TORCH_CHECK(K > 0, "linear_row_blocks: x has no columns");
  TORCH_CHECK(w_address != 0 && N > 0 && block_stride >= K * kGemmBlock && blocks * block_stride <= w_floats,
              "linear_row_blocks: the weight copy (", w_floats, " floats) does not hold ", N, " rows of ", K,
              " columns in blocks of ", kGemmBlock, " at stride ", block_stride);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "linear_row_blocks: bias must be a contiguous float32 tensor of ", N, " values");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0) return out;
  const float* xs = x.data_ptr<float>();
  const float* w = reinterpret_cast<const float*>(w_address);
  float* o = out.data_ptr<float>();
  // Rows in chunks that stay in L3 beside the weights; within a chunk the tasks are row blocks, and where
  // the blocks do not share out evenly over the threads each block's rows are split in two (else 9 blocks
  // on 2 threads would leave one idle a ninth of the time).
  constexpr int64_t kChunkRows = 1024;
  const int64_t threads = at::get_num_threads();
  const int64_t halves = (blocks % threads != 0 && blocks < 8 * threads && M >= 2 * kTileRows) ? 2 : 1;
  for (int64_t m_begin = 0; m_begin < M; m_begin += kChunkRows) {
    const int64_t m_chunk = std::min(kChunkRows, M - m_begin);
    at::parallel_for(0, blocks * halves, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t blk = task / halves, half = task % halves;
        const int64_t c0 = blk * kGemmBlock, ncols = std::min(kGemmBlock, N - c0);
        const int64_t split = m_begin + (halves == 2 ? m_chunk / 2 : m_chunk);
        const int64_t r_begin = half == 0 ? m_begin : split, r_end = half == 0 ? split : m_begin + m_chunk;
        const int64_t tiles = (r_end - r_begin + kTileRows - 1) / kTileRows;
        // The next block this thread computes, fetched into L2 a share per tile while this one computes
        // (with fewer rows the loop is held by memory anyway, and the hardware's prefetch does as well).
        const bool next = r_end - r_begin >= 4 * kTileRows && half == halves - 1 && (blk + 1) * halves < end;
        const float* ahead = next ? w + (blk + 1) * block_stride : nullptr;
        const int64_t block_lines = next ? K * kGemmBlock / 16 : 0;
        int64_t r = r_begin;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t left = r_end - r, mr = (left + (tiles - t) - 1) / (tiles - t);  // near-equal tiles
          const int64_t from = block_lines * t / tiles, to = block_lines * (t + 1) / tiles;
          kGemmTiles[mr - 1](xs + r * ldx, ldx, w + blk * block_stride, K, o + r * N + c0, N, ncols,
                             b != nullptr ? b + c0 : nullptr, next ? ahead + 16 * from : nullptr, to - from);
          r += mr;
        }
      }
    });
  }
  return out;
}

// exp(x) for 16 floats by exp_approx's approximation (Cephes: range reduction by ln 2, degree-6 polynomial,
// 2^n from the exponent bits), with fused multiply-adds.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 half = _mm512_set1_ps(0.5f), log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, log2e, half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                    _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(y, x), x), x), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

constexpr int64_t kKeys = 16;  // keys scored at once: one vector of scores per query row
constexpr int kRows = 8;       // query rows of one task

// One tile of R query rows (at positions first_pos ..) of one head against every key they see: scores of 16
// keys at once from the transposed keys ktg [D][Lp], an online softmax per row, and the value rows (value t at
// vp + vslot[t]) accumulated in acc [R][D]; out gets row r at out + r * out_row.
template <int R>
void prefill_tile(const float* q, int64_t q_row, const float* ktg, int64_t Lp, const float* vp, const int64_t* vslot,
                  int64_t D, int64_t first_pos, float scale, float* acc, float* out, int64_t out_row) {
  alignas(64) float p[R][kKeys];
  float m[R], l[R], corr[R];
  for (int r = 0; r < R; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::fill(acc, acc + R * D, 0.f);
  const int64_t last_pos = first_pos + R - 1;  // the tile's last row sees keys 0 .. last_pos
  for (int64_t c0 = 0; c0 <= last_pos; c0 += kKeys) {
    __m512 s[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 kv = _mm512_loadu_ps(ktg + d * Lp + c0);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * q_row + d]), kv, s[r]);
    }
    const int64_t keys = std::min(kKeys, last_pos + 1 - c0);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t visible = std::min<int64_t>(kKeys, first_pos + r + 1 - c0);  // causal: keys <= position
      if (visible <= 0) {
        corr[r] = 1.f;
        _mm512_store_ps(p[r], _mm512_setzero_ps());
        continue;
      }
      const __mmask16 mask = static_cast<__mmask16>(visible >= 16 ? 0xFFFF : (1u << visible) - 1);
      const __m512 sc = _mm512_mul_ps(s[r], _mm512_set1_ps(scale));
      const float mx = std::max(m[r], _mm512_mask_reduce_max_ps(mask, sc));
      const __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));
      corr[r] = _mm512_cvtss_f32(exp16(_mm512_set1_ps(m[r] - mx)));  // ~0 on the first chunk (acc is 0 then)
      l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(e);
      m[r] = mx;
      _mm512_store_ps(p[r], e);
    }
    // acc[r] = acc[r] * corr[r] + sum over the chunk's keys t of p[r][t] * V[t], four rows and 64 columns at a time
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int64_t nv = std::min<int64_t>(4, (D - d0) / 16);
      auto values = [&](auto rows_const, int r0) {
        constexpr int RH = decltype(rows_const)::value;
        __m512 a[RH][4];
#pragma GCC unroll 4
        for (int r = 0; r < RH; ++r)
          for (int v = 0; v < 4; ++v)
            a[r][v] = v < nv ? _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + r) * D + d0 + 16 * v),
                                             _mm512_set1_ps(corr[r0 + r]))
                             : _mm512_setzero_ps();
        for (int64_t t = 0; t < keys; ++t) {
          const float* vt = vp + vslot[c0 + t] + d0;
          if (nv == 4) {
            const __m512 v0 = _mm512_loadu_ps(vt), v1 = _mm512_loadu_ps(vt + 16), v2 = _mm512_loadu_ps(vt + 32),
                         v3 = _mm512_loadu_ps(vt + 48);
#pragma GCC unroll 4
            for (int r = 0; r < RH; ++r) {
              const __m512 w = _mm512_set1_ps(p[r0 + r][t]);
              a[r][0] = _mm512_fmadd_ps(w, v0, a[r][0]);
              a[r][1] = _mm512_fmadd_ps(w, v1, a[r][1]);
              a[r][2] = _mm512_fmadd_ps(w, v2, a[r][2]);
              a[r][3] = _mm512_fmadd_ps(w, v3, a[r][3]);
            }
          } else {
            for (int v = 0; v < nv; ++v) {
              const __m512 vv = _mm512_loadu_ps(vt + 16 * v);
              for (int r = 0; r < RH; ++r) a[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(p[r0 + r][t]), vv, a[r][v]);
            }
          }
        }
        for (int r = 0; r < RH; ++r)
          for (int v = 0; v < nv; ++v) _mm512_storeu_ps(acc + (r0 + r) * D + d0 + 16 * v, a[r][v]);
      };
      if constexpr (R >= 4) values(std::integral_constant<int, 4>{}, 0);
      else values(std::integral_constant<int, R>{}, 0);
      if constexpr (R > 4) values(std::integral_constant<int, R - 4>{}, 4);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) out[r * out_row + d] = acc[r * D + d] * inv;
  }
}

using PrefillTile = void (*)(const float*, int64_t, const float*, int64_t, const float*, const int64_t*, int64_t,
                             int64_t, float, float*, float*, int64_t);
template <int... R>
constexpr std::array<PrefillTile, sizeof...(R)> prefill_tiles(std::integer_sequence<int, R...>) {
  return {&prefill_tile<R + 1>...};
}
constexpr auto kPrefillTiles = prefill_tiles(std::make_integer_sequence<int, kRows>{});

void prefill_impl(const float* q, int64_t q_row, int64_t q_head, const float* kp, const float* vp,
                  const int64_t* blocks, int64_t bs, int64_t H, int64_t Hkv, int64_t D, int64_t start, int64_t n,
                  float scale, float* out) {
  const int64_t G = H / Hkv, token_stride = Hkv * D, L = start + n, Lp = (L + kKeys - 1) / kKeys * kKeys;
  std::vector<int64_t> slots(L);
  for (int64_t pos = 0; pos < L; ++pos) slots[pos] = (blocks[pos / bs] * bs + pos % bs) * token_stride;
  // Every KV head's keys transposed, [g][d][Lp] (zero past L): a chunk of 16 keys is then one vector per d.
  std::unique_ptr<float[]> kt(new float[Hkv * D * Lp]);  // every element written below
  at::parallel_for(0, Hkv * (Lp / kKeys), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / (Lp / kKeys), c0 = (task % (Lp / kKeys)) * kKeys;
      float* dst = kt.get() + g * D * Lp + c0;
      for (int64_t t = c0; t < c0 + kKeys; ++t) {
        const float* k = kp + slots[std::min(t, L - 1)] + g * D;
        for (int64_t d = 0; d < D; ++d) dst[d * Lp + (t - c0)] = t < L ? k[d] : 0.f;
      }
    }
  });
  const int64_t tiles = (n + kRows - 1) / kRows;
  at::parallel_for(0, H * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(kRows * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / tiles, tile = task % tiles, g = h / G;
      const int64_t i0 = tile * kRows, rows = std::min<int64_t>(kRows, n - i0);
      kPrefillTiles[rows - 1](q + i0 * q_row + h * q_head, q_row, kt.get() + g * D * Lp, Lp, vp + g * D,
                              slots.data(), D, start + i0, scale, acc.data(), out + (i0 * H + h) * D, H * D);
    }
  });
}

// Causal attention of one prefill chunk: q [n, H, D] (rows and heads at any stride, D contiguous) at positions
// start .. start + n - 1, against the whole context 0 .. start + n - 1 in kv_cache [2, N, bs, Hkv, D] through
// block_ids (the chunk's own K and V written there first); out [n, H, D]. SDPA on CPU reaches 60-85 GFLOP/s
// on a chunk of 100-500 tokens here; this keeps 16 keys' scores of up to 8 query rows in registers (keys
// transposed once per KV head), takes the softmax online and accumulates the values in registers.
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_ids,
                             int64_t start, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && block_ids.dim() == 1,
              "paged_prefill_attention: q [n,H,D], kv_cache [2,N,bs,Hkv,D], block_ids [blocks]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_prefill_attention: float32 only");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong, "paged_prefill_attention: block_ids must be int64");
  TORCH_CHECK(q.stride(2) == 1 && kv_cache.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes(),
              "paged_prefill_attention: q's head size must be contiguous, kv_cache and out contiguous, out shaped "
              "like q");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == D && Hkv > 0 && H % Hkv == 0,
              "paged_prefill_attention: kv_cache does not match q's heads / head size");
  TORCH_CHECK(D % 16 == 0, "paged_prefill_attention: head size ", D, " is not a multiple of 16");
  TORCH_CHECK(n > 0 && start >= 0, "paged_prefill_attention: no query rows, or a negative start");
  const at::Tensor ids = block_ids.contiguous();
  const int64_t* bt = ids.data_ptr<int64_t>();
  const int64_t needed = (start + n + bs - 1) / bs;
  TORCH_CHECK(ids.numel() >= needed, "paged_prefill_attention: ", ids.numel(), " block ids cannot hold ", start + n,
              " positions in blocks of ", bs);
  for (int64_t j = 0; j < needed; ++j) {
    TORCH_CHECK(bt[j] >= 0 && bt[j] < num_blocks, "paged_prefill_attention: block id ", bt[j], " outside 0..",
                num_blocks - 1);
  }
  const float* kp = kv_cache.data_ptr<float>();
  prefill_impl(q.data_ptr<float>(), q.stride(0), q.stride(1), kp, kp + num_blocks * bs * Hkv * D, bt, bs, H, Hkv, D,
               start, n, static_cast<float>(scale), out.data_ptr<float>());
}
#endif

}  // namespace

// Every kernel releases the GIL while it runs, as torch's own ops do: it touches no Python object,
// and the engine's event loop (another thread of the same process) must keep running meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release_gil = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU, float32), in place into out",
        release_gil());
  m.def("argmax_rows", &argmax_rows, "First index of each row's maximum (CPU, float32)", release_gil());
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (CPU, float32)", release_gil());
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm of residual (CPU, float32)",
        release_gil());
  m.def("rotary_inplace", &rotary_inplace, "Rotate-half rotary embedding of q and k, in place (CPU, float32)",
        release_gil());
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :I]) * x[:, I:] (CPU, float32)", release_gil());
  m.def("pack_rows", &pack_rows, "Rows of a linear weight into its oneDNN-reordered copy in place, and optionally "
        "into the plain weight (CPU, float32)", py::arg("src"), py::arg("row_offset"), py::arg("dst_address"),
        py::arg("dst_floats"), py::arg("block"), py::arg("block_stride"), py::arg("plain") = py::none(), release_gil());
  m.def("row_blocks_equal", &row_blocks_equal, "Whether a oneDNN-reordered copy holds the weight under pack_rows' "
        "layout, value for value (CPU, float32)", py::arg("src"), py::arg("dst_address"), py::arg("dst_floats"),
        py::arg("block"), py::arg("block_stride"), release_gil());
#if defined(__AVX512F__)
  m.def("linear_row_blocks", &linear_row_blocks, "x @ W.T (+ bias) from W's oneDNN-reordered copy in 64-row blocks "
        "(CPU, float32, AVX-512)", py::arg("x"), py::arg("w_address"), py::arg("w_floats"), py::arg("out_features"),
        py::arg("block_stride"), py::arg("bias") = py::none(), release_gil());
  m.def("paged_prefill_attention", &paged_prefill_attention, "Causal attention of one prefill chunk over its paged "
        "context, in place into out (CPU, float32, AVX-512)", py::arg("q"), py::arg("kv_cache"), py::arg("block_ids"),
        py::arg("start"), py::arg("scale"), py::arg("out"), release_gil());
#endif
}
