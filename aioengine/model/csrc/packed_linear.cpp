// aioengine's own GEMM over linear weights in oneDNN's reordered layout, in AVX-512 and AVX2 builds
// (linear_row_blocks) and its greedy form (linear_row_blocks_argmax); packed_weights.cpp writes and checks the copies.

#include "common.h"
#include "kernels.h"

namespace aioengine_cpu {

#if defined(AIOENGINE_WIDE)
constexpr int64_t kGemmBlock = 64;  // the copy's row block: 64 output columns, four AVX-512 or eight AVX2 registers
constexpr int kTileRows = 6;

#if defined(__AVX512F__)

// out[r, c] (+)= x[r, :K] . W[c, :K] (+ bias[c]) for MR rows of x and the ncols (<= 16 * NV) columns of one
// row block, whose column k holds W[c0 .. c0 + 63, k] at w + k * 64. MR x NV accumulators stay in
// registers over the K steps (6 x 4 = 24 of the 32): each step loads NV vectors of W, broadcasts MR
// values of x and issues MR * NV fused multiply-adds. With `accumulate` the accumulators start from out
// (the sums of the earlier K chunks) instead of zero; a float stored and loaded back is the same float, so
// the sums are bitwise those of one pass over the whole of K. `lines` cache lines from `prefetch` on are
// fetched into L2 over the steps (none when 0), at most PER a step (past PER * K lines the rest is left to the
// next block's first tile), spread evenly over all K steps. PER is 1 but where a tile of 2-5 rows has more
// lines than steps (block_rows): a decode step of 8-16 rows, whose two or three tiles of a block share out
// the next block's 4 K lines. There two a step reached 1.03-1.14x at 8-16 rows of the real model's shapes
// from memory (1.14x at 8), level at 1-4 and 20-64 (one row keeps one a step: two measured 0.93x there). Gaps of
// K / lines steps alone bunch them into the first steps (at 32 rows a tile's 384 lines went one a step into
// the first 384 of 576 steps, faster than memory serves them while the FMAs wait): a running remainder
// makes some gaps a step longer. With the halves' split in row_block_gemm, over 30 layers of the real
// model's shapes from memory, alternated in one process with the previous build: 1.08-1.09x at 16-32 rows,
// 1.04x at 64, 1.07x at 32 rows of a Qwen2.5-0.5B shape, level (within 3%) at 1-8 and 128-512; a whole
// decode step of the engine, where attention and the norms sit between the GEMMs, moved less than its spread.
// With `into_l1` the lines are asked for into L1 (they land in L2 as well): row_block_gemm's choice below.
template <int MR, int NV, int PER>
void gemm_tile(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K, float* __restrict out,
               int64_t ldo, int64_t ncols, bool accumulate, const float* __restrict bias, const float* prefetch,
               int64_t lines, bool into_l1) {
  __m512 acc[MR][NV];
  __mmask16 masks[NV];
  // The columns of each vector that exist (the last block's may be partial).
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) masks[v] = Wide::mask(ncols - 16 * v);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[r][v] = accumulate ? _mm512_maskz_loadu_ps(masks[v], out + r * ldo + 16 * v) : _mm512_setzero_ps();
  // Counted down: a division per step would hold the FMA port.
  // PER 1 has a branch of its own, the prefetch written out in each: the general loop's code (and a shared
  // lambda's) compiled differently, and the general loop ran 1-3% slower at 24-64 rows.
  const int64_t issue = std::min(lines, PER * K), events = PER == 1 ? issue : (issue + PER - 1) / PER;
  const int64_t gap = events > 0 ? K / events : K + 1, longer = events > 0 ? K % events : 0;
  int64_t issued = 0, until = 0, carry = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (until-- == 0) {
      if constexpr (PER == 1) {
        if (issued < issue) {
          if (into_l1) __builtin_prefetch(prefetch + 16 * issued, 0, 3);
          else __builtin_prefetch(prefetch + 16 * issued, 0, 2);
          ++issued;
        }
      } else {
#pragma GCC unroll 4
        for (int j = 0; j < PER; ++j) {
          if (issued < issue) {
            if (into_l1) __builtin_prefetch(prefetch + 16 * issued, 0, 3);
            else __builtin_prefetch(prefetch + 16 * issued, 0, 2);
            ++issued;
          }
        }
      }
      until = gap - 1;
      carry += longer;
      if (carry >= events) {
        carry -= events;
        ++until;
      }
    }
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
    if (masks[v] == 0) break;
    if (bias != nullptr) {
      const __m512 b = _mm512_maskz_loadu_ps(masks[v], bias + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[r][v] = _mm512_add_ps(acc[r][v], b);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo + 16 * v, masks[v], acc[r][v]);
  }
}

constexpr int kTileColumns = 64;  // a tile spans the whole block
#else
// The AVX2 form of gemm_tile: MR rows x 16 columns of a block (two 8-float registers), so 6 x 2 = 12 of the 16
// registers accumulate; w and out point at the tile's first column, whose columns k are still 64 floats
// apart. ncols counts the block's columns from there on (more than 16: all 16 of the tile exist). Loads of
// w read whole 16-column rows, as in the AVX-512 form: the block's padding is in the copy.
template <int MR>
void gemm_tile(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K, float* __restrict out,
               int64_t ldo, int64_t ncols, bool accumulate, const float* __restrict bias, const float* prefetch,
               int64_t lines, bool) {
  __m256 acc[MR][2];
  const __m256i masks[2] = {lanes_below(ncols), lanes_below(ncols - 8)};
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = accumulate ? _mm256_maskload_ps(out + r * ldo, masks[0]) : _mm256_setzero_ps();
    acc[r][1] = accumulate ? _mm256_maskload_ps(out + r * ldo + 8, masks[1]) : _mm256_setzero_ps();
  }
  // A line every `every` steps of K, from the outer loop: the inner one is FMAs and loads alone.
  const int64_t every = lines > 0 ? std::max<int64_t>(1, K / lines) : K;
  int64_t issued = 0;
  for (int64_t k = 0; k < K;) {
    if (issued < lines) __builtin_prefetch(prefetch + 16 * issued++, 0, 2);
    for (const int64_t end = std::min(K, k + every); k < end; ++k) {
      const __m256 w0 = _mm256_loadu_ps(w + k * kGemmBlock), w1 = _mm256_loadu_ps(w + k * kGemmBlock + 8);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256 xr = _mm256_broadcast_ss(x + r * ldx + k);
        acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
      }
    }
  }
  // Both halves with constant indices: a loop over them that may stop early keeps GCC from holding acc in
  // registers (it stored all twelve every step of K, at a third of the FMA rate).
  const __m256 b0 = bias != nullptr ? _mm256_maskload_ps(bias, masks[0]) : _mm256_setzero_ps();
  const __m256 b1 = bias != nullptr ? _mm256_maskload_ps(bias + 8, masks[1]) : _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm256_maskstore_ps(out + r * ldo, masks[0], _mm256_add_ps(acc[r][0], b0));
    _mm256_maskstore_ps(out + r * ldo + 8, masks[1], _mm256_add_ps(acc[r][1], b1));
  }
}

constexpr int kTileColumns = 16;  // four tiles across a block
#endif

using GemmTile = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, bool,
                          const float*, const float*, int64_t, bool);
// The most of K one pass over the row tiles takes: up to 64 x 2048 floats (512 KiB) of a row block, which
// stay in L2 while every tile reads them. A longer K (the down projection of a Qwen2.5-0.5B-shaped model:
// 4864) makes the whole block (1.2 MiB) outgrow L2 beside x's tiles, so each tile read it from L3: in three
// chunks that GEMM is 1.5x faster here (141 -> 218 GFLOP/s at 512 rows, 86 -> 128 at 32). Shorter K
// (the real model's at most 1536) stays one pass: chunks of 768 there gained nothing measurable.
constexpr int64_t kGemmChunkK = 2048;
// Rows in chunks that stay in L3 beside the weights; within a chunk the tasks are row blocks, and where the
// blocks do not share out evenly over the threads each block's rows are split in two (else 9 blocks on 2
// threads would leave one idle a ninth of the time), as they are from kHalvesRows rows on.
constexpr int64_t kChunkRows = 1024;
constexpr int64_t kHalvesRows = 128;  // from here on every block's rows are two tasks (row_block_gemm)

template <int PER, int... R>
constexpr std::array<GemmTile, sizeof...(R)> gemm_tiles(std::integer_sequence<int, R...>) {
#if defined(__AVX512F__)
  return {&gemm_tile<R + 1, 4, PER>...};
#else
  return {&gemm_tile<R + 1>...};  // one line a step (block_rows asks for two only of a whole-block tile)
#endif
}
// [prefetched lines a step - 1][rows - 1]
constexpr std::array<std::array<GemmTile, kTileRows>, 2> kGemmTiles = {
    gemm_tiles<1>(std::make_integer_sequence<int, kTileRows>{}),
    gemm_tiles<2>(std::make_integer_sequence<int, kTileRows>{})};

// mr rows x the ncols columns of one block, as tiles across it (one in AVX-512 builds, up to four in AVX2):
// gemm_tile's arguments, the `lines` to prefetch shared out over the tiles in order.
inline void block_rows(int64_t mr, const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo,
                       int64_t ncols, bool accumulate, const float* bias, const float* prefetch, int64_t lines,
                       bool into_l1) {
  const int64_t tiles = (ncols + kTileColumns - 1) / kTileColumns;
  for (int64_t c = 0; c < tiles; ++c) {
    const int64_t from = lines * c / tiles, to = lines * (c + 1) / tiles, col = c * kTileColumns;
    const bool two = kTileColumns == kGemmBlock && mr >= 2 && to - from > K;  // AVX-512: one tile a block
    kGemmTiles[two ? 1 : 0][mr - 1](x, ldx, w + col, K, out + col, ldo, ncols - col, accumulate,
                                    bias != nullptr ? bias + col : nullptr,
                                    prefetch != nullptr ? prefetch + 16 * from : nullptr, to - from, into_l1);
  }
}

// That W's row-block copy fits in its w_floats (kernels.h); raises, naming the kernel, where not.
void check_row_block_copy(const char* name, int64_t w_address, int64_t w_floats, int64_t N, int64_t K,
                          int64_t block_stride) {
  const int64_t blocks = (N + kGemmBlock - 1) / kGemmBlock;
  TORCH_CHECK(w_address != 0 && N > 0 && block_stride >= K * kGemmBlock && blocks * block_stride <= w_floats, name,
              ": the weight copy (", w_floats, " floats) does not hold ", N, " rows of ", K, " columns in blocks of ",
              kGemmBlock, " at stride ", block_stride);
}

// The checks and the work split of the row-block GEMM: x [M, K] @ W.T (+ bias) with W [N, K] read from its
// oneDNN-reordered copy in the row-block layout of pack_rows with a block of 64 (what oneDNN picks here for
// batches of 64 rows or more; the caller checks with row_blocks_equal). For few rows oneDNN's GEMM reaches
// 50-75% of an AVX-512 CPU's peak; this one keeps a 6 x 64 tile of the output in registers over a chunk of
// K (all of it up to 2048; AVX2: four 6 x 16 tiles across the block), reads each row block of W once from
// memory and then from L2 for the other row tiles, and splits the rows into tiles of near-equal size. On a
// 2-core AVX2 host (Zen 3) it is level with oneDNN's GEMM, 0.9-1.2x at 8-512 rows.
// Each tile also prefetches a share of the thread's next block into L2, so that block's first tile does
// not wait on memory: at 64 rows 9-13% faster here, none lost at 512; at 16-32 rows (a decode step late in
// a batch) 5-30% faster, weights cold as in a forward; none lost at 4.
// A task is rows [r_begin, r_end) of one row block: `dest(blk, r_begin, r_end)` says where its output goes
// (row r_begin, column c0 of the block, and the stride between rows), `done(blk, r_begin, r_end, dst, ldo)`
// is called once the task's sums are complete.
// The bias's floats, or null; raises, naming the kernel, where x, the copy or the bias does not fit.
const float* checked_row_blocks(const char* name, const at::Tensor& x, int64_t w_address, int64_t w_floats, int64_t N,
                                int64_t block_stride, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.device().is_cpu(), name,
              ": x must be a [rows, K] float32 CPU tensor with unit column stride");
  const int64_t K = x.size(1);
  TORCH_CHECK(K > 0, name, ": x has no columns");
  check_row_block_copy(name, w_address, w_floats, N, K, block_stride);
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, name,
              ": bias must be a contiguous float32 tensor of ", N, " values");
  return bias->data_ptr<float>();
}

template <typename Dest, typename Done>
void row_block_gemm(const at::Tensor& x, int64_t w_address, int64_t N, int64_t block_stride, const float* b, Dest dest,
                    Done done) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  const int64_t blocks = (N + kGemmBlock - 1) / kGemmBlock;
  if (M == 0) return;
  const float* xs = x.data_ptr<float>();
  const float* w = reinterpret_cast<const float*>(w_address);
  const int64_t threads = at::get_num_threads();
  // Each block's rows in two halves, two tasks: where the blocks do not share out evenly over the threads, and from
  // kHalvesRows rows on, where a block is a long task and the thread that finishes first otherwise waits at the
  // region's end for the other's last block (OpenMP waits were ~7% of tiny's prompt steps). The sums are bitwise the
  // same. Replayed prompt steps at 512 rows, alternated processes: tiny 14 of 20 pairs faster, ~3% on average;
  // real 3 of 3 (10.17-10.75 s against 10.74-10.97).
  const bool long_blocks = M >= kHalvesRows;
  const int64_t halves =
      ((blocks % threads != 0 && blocks < 8 * threads) || long_blocks) && M >= 2 * kTileRows ? 2 : 1;
  // On AMD's Zen 4 the next block's lines asked for into L1 rather than L2 keep the FMAs fed better from 24 rows
  // on and worse below: over 30 layers of the real model's shapes from memory, each build loaded beside the other
  // (outputs bitwise equal), 1.02-1.03x at 32-64 rows, level at 512, 0.88-0.99x at 1-8. (GCC 12 names that core
  // znver3 under -march=native.) Intel's cores keep the L2 hint they were measured with.
#if defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
  const bool into_l1 = M >= 24;
#else
  const bool into_l1 = false;
#endif
  for (int64_t m_begin = 0; m_begin < M; m_begin += kChunkRows) {
    const int64_t m_chunk = std::min(kChunkRows, M - m_begin);
    parallel_tasks(blocks * halves, [&](int64_t task, int64_t end) {
      const int64_t blk = task / halves, half = task % halves;
      const int64_t c0 = blk * kGemmBlock, ncols = std::min(kGemmBlock, N - c0);
      const int64_t split = m_begin + (halves == 2 ? m_chunk / 2 : m_chunk);
      const int64_t r_begin = half == 0 ? m_begin : split, r_end = half == 0 ? split : m_begin + m_chunk;
      const int64_t tiles = (r_end - r_begin + kTileRows - 1) / kTileRows;
      const auto [dst, ldo] = dest(blk, r_begin, r_end);
      const int64_t chunks = (K + kGemmChunkK - 1) / kGemmChunkK;  // near-equal K chunks, in order
      auto chunk_k = [&](int64_t ch) { return K * ch / chunks; };
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t k0 = chunk_k(ch), k1 = chunk_k(ch + 1);
        // What this chunk's tiles fetch into L2, a share per tile, while it computes: at every row count,
        // since a decode step's few rows wait on memory most of all.
        const float* target = nullptr;
        int64_t target_lines = 0;
        if (ch + 1 < chunks) {
          // A block of several chunks outgrows L2 beside the next block (1.2 MiB each at K 4864): the chunk
          // after this one; and after the last chunk (below), the first chunk of the block of the thread's
          // next task. Over 16 layers of a Qwen2.5-0.5B-shaped down projection from memory, 1.30-1.38x at
          // 8-32 rows, 1.18x at 64, 1.03-1.06x at 128-512 against the next whole block over all the chunks.
          target = w + blk * block_stride + k1 * kGemmBlock;
          target_lines = (chunk_k(ch + 2) - k1) * kGemmBlock / 16;
        } else if (chunks > 1) {
          if (task + 1 < end) {
            target = w + ((task + 1) / halves) * block_stride;
            target_lines = chunk_k(1) * kGemmBlock / 16;
          }
        } else if ((blk + 1) * halves < end) {
          // A block of one chunk: the next block this thread computes. Where a block's rows are split in two,
          // each half fetches half of it (the second half alone fetching all of it had half the time to:
          // 1.01-1.07x at 16-64 rows of the real model's shapes).
          const int64_t all_lines = K * kGemmBlock / 16, first = all_lines * half / halves;
          target = w + (blk + 1) * block_stride + 16 * first;
          target_lines = all_lines * (half + 1) / halves - first;
        }
        int64_t r = r_begin;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t left = r_end - r, mr = (left + (tiles - t) - 1) / (tiles - t);  // near-equal tiles
          const int64_t from = target_lines * t / tiles, to = target_lines * (t + 1) / tiles;
          const bool last = ch == chunks - 1;
          block_rows(mr, xs + r * ldx + k0, ldx, w + blk * block_stride + k0 * kGemmBlock, k1 - k0,
                     dst + (r - r_begin) * ldo, ldo, ncols, ch > 0, last && b != nullptr ? b + c0 : nullptr,
                     target != nullptr ? target + 16 * from : nullptr, to - from, into_l1);
          r += mr;
        }
      }
      done(blk, r_begin, r_end, dst, ldo);
    });
  }
}

at::Tensor linear_row_blocks(const at::Tensor& x, int64_t w_address, int64_t w_floats, int64_t N,
                             int64_t block_stride, const c10::optional<at::Tensor>& bias) {
  const float* b = checked_row_blocks("linear_row_blocks", x, w_address, w_floats, N, block_stride, bias);
  at::Tensor out = at::empty({x.size(0), N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  float* o = out.data_ptr<float>();
  row_block_gemm(
      x, w_address, N, block_stride, b,
      [&](int64_t blk, int64_t r_begin, int64_t) {
        return std::pair<float*, int64_t>(o + r_begin * N + blk * kGemmBlock, N);
      },
      [](int64_t, int64_t, int64_t, const float*, int64_t) {});
  return out;
}

// Whether any of row[0, n) is >= b (a NaN never is), n <= 64.
inline bool any_at_least(const float* row, int64_t n, float b) {
#if defined(__AVX512F__)
  __mmask16 any = 0;
  const __m512 bv = _mm512_set1_ps(b);
  for (int64_t v = 0; v * 16 < n; ++v) {
    const __mmask16 mask = Wide::mask(n - 16 * v);
    any |= _mm512_mask_cmp_ps_mask(mask, _mm512_maskz_loadu_ps(mask, row + 16 * v), bv, _CMP_GE_OQ);
  }
  return any != 0;
#else
  const __m256 bv = _mm256_set1_ps(b);
  int any = 0;
  for (int64_t v = 0; v * 8 < n; ++v) {
    const __m256i mask = lanes_below(n - 8 * v);
    const __m256 ge = _mm256_cmp_ps(_mm256_maskload_ps(row + 8 * v, mask), bv, _CMP_GE_OQ);
    any |= _mm256_movemask_ps(_mm256_and_ps(ge, _mm256_castsi256_ps(mask)));
  }
  return any != 0;
#endif
}

// The first maximum of every row of x [M, K] @ W.T (+ bias), as int64 [M], without writing the [M, N]
// output: greedy sampling over an lm_head. Each task's sums are those linear_row_blocks writes (the same
// tiles, in a buffer of the thread's), and each row's best column among them is merged into the thread's
// best per row; the threads' bests are merged at the end. The answer is argmax_rows' on
// linear_row_blocks' output: NaN ignored, a row with no number above -inf or none at all answers its first
// -inf or 0.
at::Tensor linear_row_blocks_argmax(const at::Tensor& x, int64_t w_address, int64_t w_floats, int64_t N,
                                    int64_t block_stride, const c10::optional<at::Tensor>& bias) {
  const float* bias_floats =
      checked_row_blocks("linear_row_blocks_argmax", x, w_address, w_floats, N, block_stride, bias);
  const int64_t M = x.size(0), threads = at::get_num_threads();
  const int64_t task_rows = std::min<int64_t>(M, kChunkRows);  // the most rows a task has
  const ScratchFloats buffers(threads * task_rows * kGemmBlock);
  std::vector<float> best(static_cast<size_t>(threads * M), -std::numeric_limits<float>::infinity());
  std::vector<int64_t> at(static_cast<size_t>(threads * M), -1);
  row_block_gemm(
      x, w_address, N, block_stride, bias_floats,
      [&](int64_t, int64_t, int64_t) {
        return std::pair<float*, int64_t>(buffers.data + at::get_thread_num() * task_rows * kGemmBlock, kGemmBlock);
      },
      [&](int64_t blk, int64_t r_begin, int64_t r_end, const float* dst, int64_t ldo) {
        const int64_t c0 = blk * kGemmBlock, ncols = std::min(kGemmBlock, N - c0), thread = at::get_thread_num();
        for (int64_t r = r_begin; r < r_end; ++r) {
          const float* row = dst + (r - r_begin) * ldo;
          float& b = best[thread * M + r];
          int64_t& a = at[thread * M + r];
          // Most blocks hold nothing at or above the row's best: one vector compare says so.
          if (a >= 0 && !any_at_least(row, ncols, b)) continue;
          for (int64_t c = 0; c < ncols; ++c) {
            if (beats(row[c], c0 + c, b, a)) b = row[c], a = c0 + c;
          }
        }
      });
  at::Tensor out = at::zeros({M}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    float b = -std::numeric_limits<float>::infinity();
    int64_t a = -1;
    for (int64_t t = 0; t < threads; ++t) {
      if (at[t * M + r] >= 0 && beats(best[t * M + r], at[t * M + r], b, a)) b = best[t * M + r], a = at[t * M + r];
    }
    op[r] = a >= 0 ? a : 0;
  }
  return out;
}
#endif

}  // namespace aioengine_cpu
