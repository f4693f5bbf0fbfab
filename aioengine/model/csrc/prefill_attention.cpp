// Causal attention of a prompt chunk over its paged context (AVX-512 and AVX2 builds), float32: the chunk's queries
// against the KV cache [2, blocks, block_size, kv_heads, head_size] through the sequence's block ids.

#include "common.h"
#include "kernels.h"

namespace aioengine_cpu {

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
  const ScratchFloats kt(Hkv * D * Lp);  // every element written below
  at::parallel_for(0, Hkv * (Lp / kKeys), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / (Lp / kKeys), c0 = (task % (Lp / kKeys)) * kKeys;
      float* dst = kt.data + g * D * Lp + c0 * D;
      for (int64_t t = c0; t < c0 + kKeys; ++t) {
        const float* k = kp + slots[std::min(t, L - 1)] + g * D;
        for (int64_t d = 0; d < D; ++d) dst[d * kKeys + (t - c0)] = t < L ? k[d] : 0.f;
      }
    }
  });
  const int64_t tiles = (n + kRows - 1) / kRows;
  const ScratchFloats acc(at::get_num_threads() * kRows * D);
  parallel_tasks(H * tiles, [&](int64_t task, int64_t) {
    const int64_t h = task / tiles, tile = task % tiles, g = h / G;
    const int64_t i0 = tile * kRows, rows = std::min<int64_t>(kRows, n - i0);
    kPrefillTiles[rows - 1](q + i0 * q_row + h * q_head, q_row, kt.data + g * D * Lp, vp + g * D, slots.data(), D,
                            start + i0, scale, acc.data + at::get_thread_num() * kRows * D, out + (i0 * H + h) * D,
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
