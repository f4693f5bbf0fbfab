// Attention over the paged KV cache [2, blocks, block_size, kv_heads, head_size], float32: decode (one query
// token per row) and, in AVX-512 and AVX2 builds, a prompt chunk (causal).

#include "common.h"
#include "kernels.h"

namespace aioengine_cpu {

// One query head against one block of keys: s[t] = scale * q . k_t for t < n, key t at k + t * stride.
// kD is the head size when known at compile time (the loops then unroll), 0 to take D at run time.
template <int64_t kD>
void block_scores(const float* q, const float* k, int64_t stride, int64_t n, int64_t D, float scale, float* s) {
  if (kD) D = kD;
  int64_t t = 0;
#if defined(__AVX512F__)
  if constexpr (kD > 0 && kD % 16 == 0) {  // whole 16-float registers: half the multiply-adds of 8-wide
    for (; t + 4 <= n; t += 4) {
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      const float* k0 = k + t * stride;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qq = _mm512_loadu_ps(q + d);
        a0 = _mm512_fmadd_ps(qq, _mm512_loadu_ps(k0 + d), a0);
        a1 = _mm512_fmadd_ps(qq, _mm512_loadu_ps(k0 + stride + d), a1);
        a2 = _mm512_fmadd_ps(qq, _mm512_loadu_ps(k0 + 2 * stride + d), a2);
        a3 = _mm512_fmadd_ps(qq, _mm512_loadu_ps(k0 + 3 * stride + d), a3);
      }
      sum8x4(fold16(a0), fold16(a1), fold16(a2), fold16(a3), s + t);
    }
  }
#endif
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
#if defined(__AVX512F__)
  if constexpr (kD > 0 && kD % 16 == 0) {
    __m512 a[kD / 16];
    for (int64_t i = 0; i < kD / 16; ++i) a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * i), _mm512_set1_ps(c));
    for (int64_t t = 0; t < n; ++t) {
      const __m512 w = _mm512_set1_ps(p[t]);
      const float* vt = v + t * stride;
      for (int64_t i = 0; i < kD / 16; ++i) a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(vt + 16 * i), w, a[i]);
    }
    for (int64_t i = 0; i < kD / 16; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
    return;
  }
#endif
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

// q [B, H, D] (rows at any stride q_row, each row's heads contiguous); kv_cache [2, num_blocks, block_size, Hkv,
// D]; block_tables [B, W] int64;
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
void paged_decode_attention_impl(const float* qp, int64_t q_row, const float* kp, const float* vp, const int64_t* bt,
                                 const int64_t* cl, float* op, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                                 int64_t bs, int64_t W, float scale) {
  const int64_t G = H / Hkv, token_stride = Hkv * D;
  const int64_t heads_per_task = B >= 4 * at::get_num_threads() ? Hkv : 1;
  const int64_t tasks_per_row = Hkv / heads_per_task;
  const int64_t lines_per_token = (heads_per_task * D + 15) / 16;  // a task's keys of one token, in cache lines
  const int64_t hq_count = heads_per_task * G, per_thread = hq_count * (bs + 2 + D);
  std::vector<float> scratch(static_cast<size_t>(at::get_num_threads() * per_thread));
  parallel_tasks(B * tasks_per_row, [&](int64_t task, int64_t end) {
    float* const scores = scratch.data() + at::get_thread_num() * per_thread;  // this thread's
    float* const running_max = scores + hq_count * bs;
    float* const running_sum = running_max + hq_count;
    float* const acc = running_sum + hq_count;
    const int64_t b = task / tasks_per_row, h0 = (task % tasks_per_row) * heads_per_task, L = cl[b];
    const int64_t* table = bt + b * W;
    const float* qb = qp + b * q_row + h0 * G * D;  // the task's query heads, hq_count of them
    std::fill(running_max, running_max + hq_count, -std::numeric_limits<float>::infinity());
    std::fill(running_sum, running_sum + hq_count, 0.f);
    std::fill(acc, acc + hq_count * D, 0.f);
    for (int64_t j = 0; j * bs < L; ++j) {
      const int64_t n = std::min(bs, L - j * bs);
      const int64_t base = table[j] * bs * token_stride + h0 * D;
      // The next block sits anywhere in the cache, where the hardware's prefetch cannot guess it: its keys
      // and values are fetched into L2 a share per query head while this block computes. After the row's last
      // block, the next task's first one (this thread's next task unless another thread takes it): a row's
      // first block otherwise waits on memory, 2-13% of the kernel's time here (more at short contexts).
      int64_t next_n = std::min(bs, L - (j + 1) * bs);
      int64_t next_base = next_n > 0 ? table[j + 1] * bs * token_stride + h0 * D : 0;
      if (next_n <= 0 && task + 1 < end) {
        const int64_t next_b = (task + 1) / tasks_per_row, next_h0 = ((task + 1) % tasks_per_row) * heads_per_task;
        next_n = std::min(bs, cl[next_b]);
        next_base = bt[next_b * W] * bs * token_stride + next_h0 * D;
      }
      const int64_t next_lines = next_n > 0 ? next_n * lines_per_token : 0;
      for (int64_t hq = 0; hq < hq_count; ++hq) {
        // The share's lines walked as (token, line of the token): one division a share, not two a line (the
        // divisions held the prefetches back: 4-9% of this kernel's time on an AVX-512 host).
        const int64_t from = next_lines * hq / hq_count, to = next_lines * (hq + 1) / hq_count;
        int64_t token = from / lines_per_token, line = from % lines_per_token;
        for (int64_t i = from; i < to; ++i) {
          const int64_t offset = next_base + token * token_stride + line * 16;
          __builtin_prefetch(kp + offset, 0, 2);
          __builtin_prefetch(vp + offset, 0, 2);
          if (++line == lines_per_token) line = 0, ++token;
        }
        const int64_t kv_offset = base + (hq / G) * D;
        float* s = scores + hq * bs;
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
        block_values<kD>(acc + hq * D, correction, s, vp + kv_offset, token_stride, n, D);
      }
    }
    float* ob = op + (b * H + h0 * G) * D;
    for (int64_t hq = 0; hq < hq_count; ++hq) {
      const float inv = 1.f / running_sum[hq];
      for (int64_t d = 0; d < D; ++d) ob[hq * D + d] = acc[hq * D + d] * inv;
    }
  });
}

// What both attention kernels need of q, the cache and out: float32, and a cache whose heads and head size
// fit q's (query head h reads KV head h / (H / Hkv)).
void check_against_cache(const char* kernel, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              kernel, ": float32 only");
  const int64_t H = q.size(1), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == q.size(2) && Hkv > 0 && H % Hkv == 0, kernel,
              ": kv_cache does not match q's heads / head size");
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2 && context_lens.dim() == 1,
              "paged_decode_attention: q [B,H,D], kv_cache [2,N,bs,Hkv,D], block_tables [B,W], context_lens [B]");
  check_against_cache("paged_decode_attention", q, kv_cache, out);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and context_lens must be int64");
  const bool heads_contiguous = q.stride(2) == 1 && (q.size(1) == 1 || q.stride(1) == q.size(2));
  TORCH_CHECK(heads_contiguous && kv_cache.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes(),
              "paged_decode_attention: each row of q must hold its heads contiguously (rows at any stride), "
              "kv_cache and out must be contiguous, out shaped like q");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3);
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
  run(q.data_ptr<float>(), q.stride(0), kp, vp, bt, cl, out.data_ptr<float>(), B, H, Hkv, D, bs, W,
      static_cast<float>(scale));
}

#if defined(AIOENGINE_WIDE)
using W = Wide;
// The tile's registers: 16 keys' scores of each of kRows query rows (one AVX-512 register or two AVX2 ones, a
// row), and the values accumulated kValueRows rows x kValueVectors registers of columns at a time. Sized so a
// loop's accumulators, its loads and a broadcast fit the register file (32 or 16) with the multiply-adds, not
// the loads, the bound.
constexpr int64_t kKeys = 16;
constexpr int kScoreVectors = kKeys / W::kLanes;
constexpr int kRows = W::kLanes == 16 ? 8 : 6;
constexpr int kValueRows = W::kLanes == 16 ? 4 : 6;
constexpr int kValueVectors = W::kLanes == 16 ? 4 : 2;

// acc[r][d0 .. d0 + kLanes * NV) = acc[r][...] * corr[r] + sum over t < keys of p[r][t] * V[t][...] for RH rows,
// V[t] at vp + vslot[t]: RH x NV accumulators in registers over the keys (a compile-time NV: with a run-time one
// the accumulators lived in memory and this loop ran at a seventh of the FMA rate).
template <int RH, int NV>
void add_values_nv(const float (*p)[kKeys], const float* corr, int64_t keys, const float* vp, const int64_t* vslot,
                   int64_t d0, int64_t D, float* acc) {
  W::V a[RH][NV];
#pragma GCC unroll 8
  for (int r = 0; r < RH; ++r) {
    const W::V c = W::set1(corr[r]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) a[r][v] = W::mul(W::load(acc + r * D + d0 + W::kLanes * v), c);
  }
  for (int64_t t = 0; t < keys; ++t) {
    const float* vt = vp + vslot[t] + d0;
    W::V vv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vv[v] = W::load(vt + W::kLanes * v);
#pragma GCC unroll 8
    for (int r = 0; r < RH; ++r) {
      const W::V w = W::set1(p[r][t]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) a[r][v] = W::fmadd(w, vv[v], a[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RH; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) W::store(acc + r * D + d0 + W::kLanes * v, a[r][v]);
}

template <int RH>
void add_values(const float (*p)[kKeys], const float* corr, int64_t keys, const float* vp, const int64_t* vslot,
                int64_t d0, int64_t D, int64_t nv, float* acc) {
  if constexpr (kValueVectors == 4) {
    if (nv == 4) return add_values_nv<RH, 4>(p, corr, keys, vp, vslot, d0, D, acc);
    if (nv == 3) return add_values_nv<RH, 3>(p, corr, keys, vp, vslot, d0, D, acc);
  }
  if (nv == 2) return add_values_nv<RH, 2>(p, corr, keys, vp, vslot, d0, D, acc);
  return add_values_nv<RH, 1>(p, corr, keys, vp, vslot, d0, D, acc);
}

// One tile of R query rows (at positions first_pos ..) of one head against every key they see: scores of
// kKeys keys at once from the transposed keys ktg [chunks][D][kKeys], an online softmax per row, and the value
// rows (value t at vp + vslot[t]) accumulated in acc [R][D]; out gets row r at out + r * out_row.
template <int R>
void prefill_tile(const float* q, int64_t q_row, const float* ktg, const float* vp, const int64_t* vslot,
                  int64_t D, int64_t first_pos, float scale, float* acc, float* out, int64_t out_row) {
  static_assert(R <= W::kLanes && R <= 2 * kValueRows,
                "one vector holds the rows' corrections, two passes their values");
  alignas(64) float p[R][kKeys];
  alignas(64) float shift[W::kLanes] = {};  // m_old - m_new of each row, then exp of it: corr
  float m[R], l[R];
  for (int r = 0; r < R; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::fill(acc, acc + R * D, 0.f);
  const int64_t last_pos = first_pos + R - 1;  // the tile's last row sees keys 0 .. last_pos
  for (int64_t c0 = 0; c0 <= last_pos; c0 += kKeys) {
    W::V s[R][kScoreVectors];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kScoreVectors; ++v) s[r][v] = W::zero();
    const float* kc = ktg + c0 * D;  // the chunk's keys, [D][kKeys]
    for (int64_t d = 0; d < D; ++d) {
      W::V kv[kScoreVectors];
      for (int v = 0; v < kScoreVectors; ++v) kv[v] = W::load(kc + d * kKeys + W::kLanes * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const W::V qq = W::set1(q[r * q_row + d]);
        for (int v = 0; v < kScoreVectors; ++v) s[r][v] = W::fmadd(qq, kv[v], s[r][v]);
      }
    }
    const int64_t keys = std::min(kKeys, last_pos + 1 - c0);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t visible = std::min<int64_t>(kKeys, first_pos + r + 1 - c0);  // causal: keys <= position
      if (visible <= 0) {
        shift[r] = 0.f;  // corr 1: the row's state stays as it is
        for (int v = 0; v < kScoreVectors; ++v) W::store(p[r] + W::kLanes * v, W::zero());
        continue;
      }
      W::V sc[kScoreVectors];
      float mx = m[r];
      for (int v = 0; v < kScoreVectors; ++v) {
        sc[v] = W::mul(s[r][v], W::set1(scale));
        if (visible > W::kLanes * v) mx = std::max(mx, W::max_below(sc[v], visible - W::kLanes * v));
      }
      for (int v = 0; v < kScoreVectors; ++v) {
        W::store(p[r] + W::kLanes * v, W::zero_from(exp_wide(W::sub(sc[v], W::set1(mx))), visible - W::kLanes * v));
      }
      shift[r] = m[r] - mx;  // -inf on the first chunk: corr ~0 (acc is 0 then)
      m[r] = mx;
    }
    W::store(shift, exp_wide(W::load(shift)));  // every row's corr at once
    const float* corr = shift;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      W::V e = W::load(p[r]);
      for (int v = 1; v < kScoreVectors; ++v) e = W::add(e, W::load(p[r] + W::kLanes * v));
      l[r] = l[r] * corr[r] + W::sum(e);
    }
    // acc[r] = acc[r] * corr[r] + sum over the chunk's keys t of p[r][t] * V[t]
    for (int64_t d0 = 0; d0 < D; d0 += W::kLanes * kValueVectors) {
      const int64_t nv = std::min<int64_t>(kValueVectors, (D - d0) / W::kLanes);
      if constexpr (R >= kValueRows) add_values<kValueRows>(p, corr, keys, vp, vslot + c0, d0, D, nv, acc);
      else add_values<R>(p, corr, keys, vp, vslot + c0, d0, D, nv, acc);
      if constexpr (R > kValueRows) {
        add_values<R - kValueRows>(p + kValueRows, corr + kValueRows, keys, vp, vslot + c0, d0, D, nv,
                                   acc + kValueRows * D);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) out[r * out_row + d] = acc[r * D + d] * inv;
  }
}

using PrefillTile = void (*)(const float*, int64_t, const float*, const float*, const int64_t*, int64_t, int64_t,
                             float, float*, float*, int64_t);
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
  // Every KV head's keys transposed chunk by chunk, [g][Lp / kKeys][d][kKeys] (zero past L): a chunk's keys are
  // then one run of memory, kScoreVectors registers per d. (Transposed whole, [g][d][Lp], a chunk's rows sat Lp
  // floats apart, a power of two as often as not, and in a handful of the L1 cache's sets.)
  std::unique_ptr<float[]> kt(new float[Hkv * D * Lp]);  // every element written below
  at::parallel_for(0, Hkv * (Lp / kKeys), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / (Lp / kKeys), c0 = (task % (Lp / kKeys)) * kKeys;
      float* dst = kt.get() + g * D * Lp + c0 * D;
      for (int64_t t = c0; t < c0 + kKeys; ++t) {
        const float* k = kp + slots[std::min(t, L - 1)] + g * D;
        for (int64_t d = 0; d < D; ++d) dst[d * kKeys + (t - c0)] = t < L ? k[d] : 0.f;
      }
    }
  });
  const int64_t tiles = (n + kRows - 1) / kRows;
  std::vector<float> acc(static_cast<size_t>(at::get_num_threads() * kRows * D));
  parallel_tasks(H * tiles, [&](int64_t task, int64_t) {
    const int64_t h = task / tiles, tile = task % tiles, g = h / G;
    const int64_t i0 = tile * kRows, rows = std::min<int64_t>(kRows, n - i0);
    kPrefillTiles[rows - 1](q + i0 * q_row + h * q_head, q_row, kt.get() + g * D * Lp, vp + g * D, slots.data(), D,
                            start + i0, scale, acc.data() + at::get_thread_num() * kRows * D, out + (i0 * H + h) * D,
                            H * D);
  });
}

// Causal attention of one prefill chunk: q [n, H, D] (rows and heads at any stride, D contiguous) at positions
// start .. start + n - 1, against the whole context 0 .. start + n - 1 in kv_cache [2, N, bs, Hkv, D] through
// block_ids (the chunk's own K and V written there first); out [n, H, D]. SDPA on CPU reaches 60-85 GFLOP/s
// on a chunk of 100-500 tokens here; this keeps 16 keys' scores of up to 8 query rows (6 in AVX2) in registers
// (keys transposed once per KV head), takes the softmax online and accumulates the values in registers.
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_ids,
                             int64_t start, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && block_ids.dim() == 1,
              "paged_prefill_attention: q [n,H,D], kv_cache [2,N,bs,Hkv,D], block_ids [blocks]");
  check_against_cache("paged_prefill_attention", q, kv_cache, out);
  TORCH_CHECK(block_ids.scalar_type() == at::kLong, "paged_prefill_attention: block_ids must be int64");
  TORCH_CHECK(q.stride(2) == 1 && kv_cache.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes(),
              "paged_prefill_attention: q's head size must be contiguous, kv_cache and out contiguous, out shaped "
              "like q");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3);
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

}  // namespace aioengine_cpu
