// Greedy over an lm_head in two passes, exact: a bfloat16 screen of every row, then float32 for the few rows the
// screen cannot rule out (AVX-512 builds with AVX512-BF16). The answer is linear_row_blocks_argmax's, bitwise:
// the rows recomputed are summed as its tiles sum them, and every row left out is proven below the winner.
//
// The screen reads a bfloat16 copy of W (half the bytes of the float32 one, and VDPBF16PS does two multiply-adds
// per lane where VFMADD does one). For x and a row w, with x~, w~ their bfloat16 roundings and a~ the screen's
// sum (its products exact in float32, its K additions rounded):
//   |x.w - a~| <= |x - x~| |w| + |x~| |w - w~| + g (|x~| |w~|),     g = K u / (1 - K u),  u = 2^-23
// (Cauchy-Schwarz on the rounding errors, the usual bound on the additions; u covers any faithful rounding), and
// the float32 sum f of the tiles is within g |x| |w| of x.w. So f lies within B of a~, with B their sum plus
// slack for the bias's addition, for B itself being computed in float32, and for products and sums that flush to
// zero. The row with the largest a~ - B has f >= a~ - B; a row whose a~ + B is below that can not be the maximum
// (nor tie it), so only rows with a~ + B at or above it are summed in float32. The norms of W's rows and of their
// rounding errors are computed once, with the copy (pack_bf16_screen).

#include "common.h"
#include "kernels.h"

namespace aioengine_cpu {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {

constexpr int64_t kBlock = 64;  // columns of W per block of the copy, as in the float32 copy
constexpr int kTileRows = 6;
constexpr int64_t kMaxRows = 1024;  // rows of x one call screens (a greedy step has at most max_num_seqs)

// 16 floats (as their bits) rounded to bfloat16, to nearest, ties to even, each in the upper half of its 32 bits,
// the lower half zero: results below the normal range flushed to zero (so no denormal reaches VDPBF16PS, which
// reads one as zero), inf kept, NaN kept a NaN. The values a float of those bits holds are what the norms use.
inline __m512i round_bf16(__m512i bits) {
  const __m512i exponent = _mm512_set1_epi32(0x7F800000);
  const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, exponent), exponent);  // inf, NaN
  const __mmask16 low = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0xFFFF));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  r = _mm512_mask_mov_epi32(r, special, _mm512_mask_or_epi32(bits, low, bits, _mm512_set1_epi32(0x400000)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 tiny = _mm512_testn_epi32_mask(r, exponent);
  return _mm512_mask_and_epi32(r, tiny, r, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
}

// A float rounded up to the next float: a norm computed in double and stored as float stays an upper bound.
inline float up(double v) { return std::nextafter(static_cast<float>(v), std::numeric_limits<float>::infinity()); }

// The three squared norms a bound needs, |v|^2, |v - v~|^2 and |v~|^2, summed lane by lane in double over the
// vectors added: for W's copy each lane is a column (a row of W), for x the lanes are summed at the end.
struct SquareSums {
  __m512d sums[3][2] = {};  // [quantity][lanes 0-7, 8-15]

  // v and its rounding (round_bf16's bits); returns the rounding. v - v~ is exact (Sterbenz, or v~ = 0).
  __m512i add(__m512 v) {
    const __m512i rounded = round_bf16(_mm512_castps_si512(v));
    const __m512 back = _mm512_castsi512_ps(rounded);
    const __m512 parts[3] = {v, _mm512_sub_ps(v, back), back};
    for (int q = 0; q < 3; ++q) {
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(parts[q]));
      const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(parts[q]), 1)));
      sums[q][0] = _mm512_fmadd_pd(lo, lo, sums[q][0]);
      sums[q][1] = _mm512_fmadd_pd(hi, hi, sums[q][1]);
    }
    return rounded;
  }
  void lanes(int q, double* out) const {
    _mm512_storeu_pd(out, sums[q][0]);
    _mm512_storeu_pd(out + 8, sums[q][1]);
  }
  double total(int q) const { return _mm512_reduce_add_pd(_mm512_add_pd(sums[q][0], sums[q][1])); }
};

// out[r][0..63] = x~[r] . w~[c] for MR rows and the 64 columns of one block: the block's pair p of K holds, for
// each column c, (w~[c, 2p], w~[c, 2p + 1]) at w + p * 128 + 2c; x's pairs are 32-bit words.
template <int MR>
void screen_tile(const uint32_t* __restrict x, int64_t ldx, const uint16_t* __restrict w, int64_t pairs,
                 float* __restrict out) {
  __m512 acc[MR][4];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + p * 2 * kBlock + 32 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + p]));
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xr, wv[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + r * kBlock + 16 * v, acc[r][v]);
}

using ScreenTile = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, float*);
constexpr ScreenTile kScreenTiles[kTileRows] = {&screen_tile<1>, &screen_tile<2>, &screen_tile<3>,
                                                &screen_tile<4>, &screen_tile<5>, &screen_tile<6>};

struct Candidate {
  int64_t column;
  float high;  // a~ + B: the most its float32 sum can be
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> pack_bf16_screen(int64_t w_address, int64_t w_floats, int64_t N, int64_t K,
                                                    int64_t block_stride, const c10::optional<at::Tensor>& into_packed,
                                                    const c10::optional<at::Tensor>& into_norms) {
  const int64_t pairs = (K + 1) / 2, blocks = (N + kBlock - 1) / kBlock;
  TORCH_CHECK(K > 0, "pack_bf16_screen: the weight has no columns");
  check_row_block_copy("pack_bf16_screen", w_address, w_floats, N, K, block_stride);
  // Into the previous copy where it has this shape (a swap's rebuild then touches no fresh pages), else anew.
  const at::TensorOptions options = at::TensorOptions().device(at::kCPU);
  auto fits = [](const c10::optional<at::Tensor>& t, at::IntArrayRef shape, at::ScalarType dtype) {
    return t.has_value() && t->sizes() == shape && t->scalar_type() == dtype && t->is_contiguous() && t->is_cpu();
  };
  const std::vector<int64_t> packed_shape{blocks, pairs, 2 * kBlock}, norms_shape{3, N};
  at::Tensor packed = fits(into_packed, packed_shape, at::kShort) ? *into_packed
                                                                  : at::empty(packed_shape, options.dtype(at::kShort));
  at::Tensor norms = fits(into_norms, norms_shape, at::kFloat) ? *into_norms
                                                               : at::empty(norms_shape, options.dtype(at::kFloat));
  const float* src = reinterpret_cast<const float*>(w_address);
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<int16_t>());
  float* n = norms.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const float* block = src + blk * block_stride;  // column c's value k at block[k * 64 + c]
      uint32_t* out = dst + blk * pairs * kBlock;       // pair p's word for column c at out[p * 64 + c]
      const int64_t ncols = std::min(kBlock, N - blk * kBlock);
      for (int64_t g = 0; g < kBlock / 16; ++g) {  // 16 columns at a time; those past N (and past K) as zeros
        const __mmask16 mask = Wide::mask(ncols - 16 * g);
        SquareSums sums;
        for (int64_t p = 0; p < pairs; ++p) {
          const __m512 even = _mm512_maskz_loadu_ps(mask, block + 2 * p * kBlock + 16 * g);
          const __m512 odd = 2 * p + 1 < K ? _mm512_maskz_loadu_ps(mask, block + (2 * p + 1) * kBlock + 16 * g)
                                           : _mm512_setzero_ps();
          const __m512i re = sums.add(even), ro = sums.add(odd);
          _mm512_storeu_si512(out + p * kBlock + 16 * g,
                              _mm512_or_si512(ro, _mm512_srli_epi32(re, 16)));  // value k even in the low half
        }
        double columns[3][16];
        for (int q = 0; q < 3; ++q) sums.lanes(q, columns[q]);
        for (int64_t c = 0; c < std::min<int64_t>(16, ncols - 16 * g); ++c) {
          const int64_t row = blk * kBlock + 16 * g + c;
          for (int q = 0; q < 3; ++q) n[q * N + row] = up(std::sqrt(columns[q][c]));
        }
      }
    }
  });
  return {packed, norms};
}

// The first maximum of each row of x @ W.T (+ bias) as linear_row_blocks_argmax computes it ([M] int64), or an
// empty tensor where the screen cannot answer (x not finite, too many rows, or too many rows of W left for the
// float32 pass: the caller then runs linear_row_blocks_argmax). The rows left are summed from W's float32
// row-block copy (linear_row_blocks' arguments), which the bfloat16 one was made from.
at::Tensor greedy_screen_argmax(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& norms,
                                int64_t w_address, int64_t w_floats, int64_t N, int64_t block_stride,
                                const c10::optional<at::Tensor>& bias) {
  const float* b = checked_row_blocks("greedy_screen_argmax", x, w_address, w_floats, N, block_stride, bias);
  const int64_t M = x.size(0), K = x.size(1), pairs = (K + 1) / 2;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  TORCH_CHECK(packed.scalar_type() == at::kShort && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == blocks && packed.size(1) == pairs && packed.size(2) == 2 * kBlock,
              "greedy_screen_argmax: the bfloat16 copy does not hold ", N, " rows of ", K, " columns");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.dim() == 2 &&
                  norms.size(0) == 3 && norms.size(1) == N,
              "greedy_screen_argmax: norms must be pack_bf16_screen's [3, ", N, "] float32");
  const at::Tensor none = at::empty({0}, x.options().dtype(at::kLong));
  if (M == 0 || M > kMaxRows) return none;

  // x~ as pairs, and the three terms of each row's bound that depend on x alone.
  const float* xs = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  std::vector<uint32_t> xp(static_cast<size_t>(M * pairs), 0);
  std::vector<float> c_whole(M), c_error(M), c_rounded(M);
  const double g = static_cast<double>(K) * 0x1p-23 / (1.0 - static_cast<double>(K) * 0x1p-23);
  const double slack = 1.0 + 0x1p-20;
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = xs + r * ldx;
    uint16_t* pr = reinterpret_cast<uint16_t*>(xp.data() + r * pairs);  // value k at pr[k]: k even in the low half
    SquareSums sums;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = Wide::mask(K - k);
      const __m512i rounded = sums.add(_mm512_maskz_loadu_ps(mask, xr + k));
      _mm512_mask_cvtepi32_storeu_epi16(pr + k, mask, _mm512_srli_epi32(rounded, 16));
    }
    const double whole = sums.total(0), error = sums.total(1), rounded = sums.total(2);
    if (!std::isfinite(whole) || !std::isfinite(rounded)) return none;
    // B = |x - x~| |w| + |x~| |w - w~| + g (|x~| |w~| + |x| |w|), each factor rounded up.
    c_whole[r] = up((std::sqrt(error) + g * std::sqrt(whole)) * slack);
    c_error[r] = up(std::sqrt(rounded) * slack);
    c_rounded[r] = up(g * std::sqrt(rounded) * slack);
  }
  const float* wn = norms.data_ptr<float>();
  const float* en = wn + N;
  const float* tn = wn + 2 * N;
  // Flushed products and sums (at most 2^-126 each, K of them) and the float32 arithmetic of a~ + bias and of
  // a~ +- B (a few ulp of their size): far below these.
  const float absolute = static_cast<float>(K) * 0x1p-120f, relative = 0x1p-20f;

  const int64_t threads = at::get_num_threads();
  const ScratchFloats tiles(threads * M * kBlock);
  std::vector<float> lows(static_cast<size_t>(threads * M), -std::numeric_limits<float>::infinity());
  std::vector<std::vector<Candidate>> found(static_cast<size_t>(threads * M));
  const uint16_t* wb = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
  std::atomic<bool> unbounded{false};
  parallel_tasks(blocks, [&](int64_t blk, int64_t) {
    const int64_t thread = at::get_thread_num(), c0 = blk * kBlock, ncols = std::min(kBlock, N - c0);
    float* out = tiles.data + thread * M * kBlock;
    const int64_t row_tiles = (M + kTileRows - 1) / kTileRows;
    for (int64_t t = 0, r = 0; t < row_tiles; ++t) {
      const int64_t mr = (M - r + (row_tiles - t) - 1) / (row_tiles - t);
      kScreenTiles[mr - 1](xp.data() + r * pairs, pairs, wb + blk * pairs * 2 * kBlock, pairs, out + r * kBlock);
      r += mr;
    }
    for (int64_t r = 0; r < M; ++r) {
      float& low_best = lows[thread * M + r];
      std::vector<Candidate>& list = found[thread * M + r];
      float* row = out + r * kBlock;
      const __m512 cw = _mm512_set1_ps(c_whole[r]), ce = _mm512_set1_ps(c_error[r]), ct = _mm512_set1_ps(c_rounded[r]);
      __m512 highs[4];
      for (int v = 0; v * 16 < ncols; ++v) {
        const __mmask16 mask = Wide::mask(ncols - 16 * v);
        __m512 a = _mm512_loadu_ps(row + 16 * v);
        if (b != nullptr) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(mask, b + c0 + 16 * v));
        __m512 bound = _mm512_mul_ps(cw, _mm512_maskz_loadu_ps(mask, wn + c0 + 16 * v));
        bound = _mm512_fmadd_ps(ce, _mm512_maskz_loadu_ps(mask, en + c0 + 16 * v), bound);
        bound = _mm512_fmadd_ps(ct, _mm512_maskz_loadu_ps(mask, tn + c0 + 16 * v), bound);
        bound = _mm512_fmadd_ps(_mm512_set1_ps(relative), _mm512_add_ps(_mm512_abs_ps(a), bound),
                                _mm512_add_ps(bound, _mm512_set1_ps(absolute)));
        // A bound that is not finite (a huge row, or sums that overflowed) leaves the answer to float32.
        if (_mm512_mask_cmp_ps_mask(mask, _mm512_add_ps(a, bound), _mm512_set1_ps(3e38f), _CMP_NLT_UQ) != 0)
          unbounded.store(true, std::memory_order_relaxed);
        low_best = std::max(low_best, _mm512_mask_reduce_max_ps(mask, _mm512_sub_ps(a, bound)));
        highs[v] = _mm512_add_ps(a, bound);
      }
      for (int v = 0; v * 16 < ncols; ++v) {
        __mmask16 keep = _mm512_mask_cmp_ps_mask(Wide::mask(ncols - 16 * v), highs[v], _mm512_set1_ps(low_best),
                                                 _CMP_GE_OQ);
        if (keep == 0) continue;
        float high[16];
        _mm512_storeu_ps(high, highs[v]);
        for (; keep != 0; keep &= keep - 1) {
          const int lane = __builtin_ctz(keep);
          list.push_back({c0 + 16 * v + lane, high[lane]});
        }
      }
    }
  });
  if (unbounded.load()) return none;

  // Each row's candidates: those of every thread whose high reaches the row's floor (the best a~ - B of all).
  std::vector<std::vector<int64_t>> left(static_cast<size_t>(M));
  int64_t total = 0;
  for (int64_t r = 0; r < M; ++r) {
    float low = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < threads; ++t) low = std::max(low, lows[t * M + r]);
    for (int64_t t = 0; t < threads; ++t)
      for (const Candidate& c : found[t * M + r])
        if (c.high >= low) left[r].push_back(c.column);
    std::sort(left[r].begin(), left[r].end());
    total += static_cast<int64_t>(left[r].size());
  }
  // Past a sixteenth of W, the float32 pass over those rows costs more than the float32 GEMM saves.
  if (total * 16 > M * N) return none;

  at::Tensor result = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* res = result.data_ptr<int64_t>();
  const float* w = reinterpret_cast<const float*>(w_address);
  parallel_tasks(M, [&](int64_t r, int64_t) {
    const std::vector<int64_t>& cols = left[r];
    const float* xr = xs + r * ldx;
    float best = -std::numeric_limits<float>::infinity();
    int64_t at = -1;
    // Eight candidates at a time, each summed over k in order with one fused multiply-add a step from zero, as
    // the float32 tile sums its columns, then the bias added: bitwise the tile's value.
    for (size_t i = 0; i < cols.size(); i += 8) {
      const int lanes = static_cast<int>(std::min<size_t>(8, cols.size() - i));
      int64_t offsets[8];
      for (int l = 0; l < 8; ++l) {
        const int64_t c = cols[i + std::min(l, lanes - 1)];
        offsets[l] = (c / kBlock) * block_stride + c % kBlock;
      }
      const __m512i idx = _mm512_loadu_si512(offsets);
      __m256 acc = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        const __m256 wv = _mm512_i64gather_ps(idx, w + k * kBlock, 4);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(xr[k]), wv, acc);
      }
      float sums[8];
      _mm256_storeu_ps(sums, acc);
      for (int l = 0; l < lanes; ++l) {
        const int64_t c = cols[i + l];
        const float v = b != nullptr ? sums[l] + b[c] : sums[l];
        if (beats(v, c, best, at)) best = v, at = c;
      }
    }
    res[r] = at;
  });
  for (int64_t r = 0; r < M; ++r)
    if (res[r] < 0) return none;  // no candidate compared (NaN sums): float32's rules for those
  return result;
}
#endif

}  // namespace aioengine_cpu
