// Greedy argmax and the elementwise parts of a Llama layer (RMSNorm with and without the residual add,
// rotary, SiLU-and-mul), float32, one pass each instead of 5-12 torch ops.

#include "common.h"
#include "kernels.h"

namespace aioengine_cpu {

// Index of the first maximum of every row of x [B, V] float32 (greedy sampling), as int64 [B].
// torch.argmax walks each row with index bookkeeping that does not vectorise; this takes the row's
// max in a vectorisable pass, then finds its first occurrence. NaN entries are ignored.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "argmax_rows: x must be [B, V>0] float32");
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

// The rows of x [..., D] normed into a new tensor shaped like it: `row(r, x_row)` returns the row to norm
// (x's own, or one it computed in place) and its sum of squares; write_normed writes the output row.
template <typename Row>
at::Tensor norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, Row row) {
  const int64_t D = weight.numel();
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, xc.numel() / D, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto [h, ss] = row(r, xp + r * D);
      write_normed(h, wp, op + r * D, D, ss, feps);
    }
  });
  return out;
}

// RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  const int64_t D = weight.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == D && weight.is_contiguous(), "rms_norm: x's last dim must match weight");
  return norm_rows(x, weight, eps, [D](int64_t, const float* xr) {
    float ss = 0.f;
    for (int64_t d = 0; d < D; ++d) ss += xr[d] * xr[d];
    return std::pair<const float*, float>(xr, ss);
  });
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
  float* rp = residual.data_ptr<float>();
  return norm_rows(x, weight, eps, [D, rp](int64_t r, const float* xr) {
    float* rr = rp + r * D;
    float ss = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const float h = rr[d] + xr[d];
      rr[d] = h;
      ss += h * h;
    }
    return std::pair<const float*, float>(rr, ss);
  });
}

// The rotary tables cos/sin (contiguous float32 [P, D]) and T int64 positions within them, as `kernel` takes
// them; raises, naming it, where they are not. The positions, contiguous.
at::Tensor checked_rotary_positions(const char* kernel, const at::Tensor& positions, int64_t T, int64_t D,
                                    const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              kernel, ": cos/sin must be contiguous float32 [positions, ", D, "]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == T, kernel,
              ": one int64 position per token");
  at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), kernel, ": position ", pp[t], " outside the table");
  }
  return pos;
}

// Rotate-half rotary embedding in place on q [T, Hq, D] and k [T, Hk, D] (last dim contiguous, any
// token/head strides: they may be views into the fused qkv output), from cos/sin tables [P, D].
void rotary_inplace(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat, "rotary_inplace: float32 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
              q.stride(2) == 1 && k.stride(2) == 1, "rotary_inplace: q, k must be [T, H, D] with D contiguous");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  const at::Tensor pos = checked_rotary_positions("rotary_inplace", positions, T, D, cos, sin);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  auto rotate = [&](at::Tensor& x, int64_t t) {
    float* base = x.data_ptr<float>() + t * x.stride(0);
    const float* c = cp + pp[t] * D;
    const float* s = sp + pp[t] * D;
    for (int64_t h = 0; h < x.size(1); ++h) {
      float* v = base + h * x.stride(1);
      rotate_head(v, v, c, s, half);
    }
  };
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate(q, t);
      rotate(k, t);
    }
  });
}

// SwiGLU's activation: x [T, 2I] -> silu(x[:, :I]) * x[:, I:] as [T, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [T, 2I] float32");
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
      int64_t i = 0;
#if defined(AIOENGINE_WIDE)
      // A register at a time: GCC left the scalar form's exp half vectorised (2.3 G elements/s a core here).
      for (; i + Wide::kLanes <= I; i += Wide::kLanes) {
        const Wide::V gv = Wide::load(g + i);
        const Wide::V e = exp_wide(Wide::sub(Wide::zero(), gv));
        Wide::store(o + i, Wide::mul(Wide::div(gv, Wide::add(Wide::set1(1.f), e)), Wide::load(u + i)));
      }
#endif
      for (; i < I; ++i) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace aioengine_cpu
