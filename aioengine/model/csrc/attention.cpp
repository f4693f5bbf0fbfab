// Decode attention over the paged KV cache [2, blocks, block_size, kv_heads, head_size], float32: one query token
// per row (a prompt chunk's causal attention is in prefill_attention.cpp).

#include "common.h"
#include "kernels.h"

namespace aioengine_cpu {

// One query head against one block of keys: s[t] = q . k_t for t < n, key t at k + t * stride (block_softmax scales).
// kD is the head size when known at compile time (the loops then unroll), 0 to take D at run time.
template <int64_t kD>
void block_scores(const float* q, const float* k, int64_t stride, int64_t n, int64_t D, float* s) {
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
}

#if defined(AIOENGINE_WIDE)
// A register of scores that block_scores wrote four at a time, loaded a quarter at a time: a load that spans
// several stores cannot take its data from them and waits for them to reach the cache, where one that matches a
// store takes it at once. On Zen 4 the whole-register load stalled ~7% of this kernel's samples; loaded so, the
// kernel took 0.55-0.57 ms a layer of the real model's shapes (64 rows, keys and values in L3) in 5 of 6 processes
// (0.79 in one) against 0.56-0.67, bitwise the same output.
inline Wide::V load_quarters(const float* p) {
#if defined(__AVX512F__)
  __m512 v = _mm512_castps128_ps512(_mm_loadu_ps(p));
  v = _mm512_insertf32x4(v, _mm_loadu_ps(p + 4), 1);
  v = _mm512_insertf32x4(v, _mm_loadu_ps(p + 8), 2);
  return _mm512_insertf32x4(v, _mm_loadu_ps(p + 12), 3);
#else
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), _mm_loadu_ps(p + 4), 1);
#endif
}
#endif

// One query head's online softmax over a block of n scores: s[t] <- exp(scale * s[t] - m) with m the running
// maximum taken over the block's scaled scores too, the running sum rescaled and the block's added; returns the
// correction exp(old max - m) by which the values summed so far are to be rescaled (~0 on the first block). In
// wide builds a register of scores at a time (s is padded to whole registers; lanes from n on are not read as
// scores and come out 0). The scalar form held the kernel to ~59 ns a token (64 rows, 9 query heads, 2 threads,
// keys and values in L3) where this one takes ~39, 40 GB/s of cache read where the scalar form managed 26 from
// anywhere. From memory (30 layers' caches in turn) both read at the memory's ~30 GB/s.
inline float block_softmax(float* s, int64_t n, float scale, float& running_max, float& running_sum) {
  float m = running_max, sum = 0.f;
#if defined(AIOENGINE_WIDE)
  for (int64_t t = 0; t < n; t += Wide::kLanes) {
    const Wide::V v = Wide::mul(load_quarters(s + t), Wide::set1(scale));
    m = std::max(m, Wide::max_below(v, n - t));
    Wide::store(s + t, v);
  }
  Wide::V total = Wide::zero();
  for (int64_t t = 0; t < n; t += Wide::kLanes) {
    const Wide::V p = Wide::zero_from(exp_wide(Wide::sub(Wide::load(s + t), Wide::set1(m))), n - t);
    total = Wide::add(total, p);
    Wide::store(s + t, p);
  }
  sum = Wide::sum(total);
#else
  for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t] *= scale);
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_approx(s[t] - m);
    sum += s[t];
  }
#endif
  const float correction = exp_approx(running_max - m);
  running_sum = running_sum * correction + sum;
  running_max = m;
  return correction;
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
  // Each head's scores padded to whole registers (block_softmax reads them so).
  const int64_t score_slot = (bs + 15) / 16 * 16, hq_count = heads_per_task * G;
  // Each part of a thread's scratch starts on a 64-byte line, so do the scores of each head and (D a multiple of
  // 16) its accumulators.
  const int64_t stat_slot = (hq_count + 15) / 16 * 16;
  const int64_t per_thread = (hq_count * (score_slot + D) + 2 * stat_slot + 15) / 16 * 16;
  const ScratchFloats scratch(at::get_num_threads() * per_thread);
  // Where block j of task t's row begins in K (and in V), at the task's first KV head.
  auto block_base = [&](int64_t t, int64_t j) {
    return bt[(t / tasks_per_row) * W + j] * bs * token_stride + (t % tasks_per_row) * heads_per_task * D;
  };
  parallel_tasks(B * tasks_per_row, [&](int64_t task, int64_t end) {
    float* const scores = scratch.data + at::get_thread_num() * per_thread;  // this thread's
    float* const running_max = scores + hq_count * score_slot;
    float* const running_sum = running_max + stat_slot;
    float* const acc = running_sum + stat_slot;
    const int64_t b = task / tasks_per_row, h0 = (task % tasks_per_row) * heads_per_task, L = cl[b];
    const float* qb = qp + b * q_row + h0 * G * D;  // the task's query heads, hq_count of them
    std::fill(running_max, running_max + hq_count, -std::numeric_limits<float>::infinity());
    std::fill(running_sum, running_sum + hq_count, 0.f);
    std::fill(acc, acc + hq_count * D, 0.f);
    for (int64_t j = 0; j * bs < L; ++j) {
      const int64_t n = std::min(bs, L - j * bs);
      const int64_t base = block_base(task, j);
      // The next block sits anywhere in the cache, where the hardware's prefetch cannot guess it: its keys
      // and values are fetched into L2 a share per query head while this block computes. After the row's last
      // block, the next task's first one (this thread's next task unless another thread takes it): a row's
      // first block otherwise waits on memory, 2-13% of the kernel's time here (more at short contexts).
      int64_t next_n = std::min(bs, L - (j + 1) * bs);
      int64_t next_base = next_n > 0 ? block_base(task, j + 1) : 0;
      if (next_n <= 0 && task + 1 < end) {
        next_n = std::min(bs, cl[(task + 1) / tasks_per_row]);
        next_base = block_base(task + 1, 0);
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
        float* s = scores + hq * score_slot;
        block_scores<kD>(qb + hq * D, kp + kv_offset, token_stride, n, D, s);
        const float correction = block_softmax(s, n, scale, running_max[hq], running_sum[hq]);
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
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B,
              "paged_decode_attention: one table row per query");
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

}  // namespace aioengine_cpu
