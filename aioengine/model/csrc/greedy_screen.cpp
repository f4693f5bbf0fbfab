// Greedy over an lm_head in two passes, exact: a screen of every row in reduced precision, then float32 for the
// few rows the screen cannot rule out (AVX-512 builds with AVX512-BF16 and AVX512-VNNI). The answer is
// linear_row_blocks_argmax's, bitwise: the rows recomputed are summed as its tiles sum them, and every row left out
// is proven below the winner.
//
// The screen's copy of W splits the K dimensions in two (`order`, chosen by the caller): the first `int8_dims` of
// them in int8, each row of W with a scale of its own (VPDPBUSD: four multiply-adds a lane), the rest in bfloat16
// (VDPBF16PS: two a lane, where VFMADD does one). A trained model's final hidden rows hold most of their energy in
// a few fixed dimensions; with those in bfloat16 and the rest in int8 the screen rules out as many rows as a
// bfloat16 screen of everything, at nearly half its multiply-adds and bytes. With int8_dims 0 it is a bfloat16
// screen. For x and a row w, split so (x_I, x_B), (w_I, w_B), with x~, w~ the values the screen multiplies (x~_I =
// s_x q_x, w~_I = s_w q_w with integers q; x~_B, w~_B bfloat16 roundings) and a~ the screen's sum (the int8 part's
// integer sum exact, turned into a float and scaled by s_w s_x with three roundings; then the bfloat16 products
// added, exact in float32, with at most K additions rounded):
//   |x.w - a~| <= |x_I - x~_I| |w_I| + |x~_I| |w_I - w~_I| + 4u |x~_I| |w~_I|
//               + |x_B - x~_B| |w_B| + |x~_B| |w_B - w~_B| + g (|x~_I| |w~_I| (1 + 4u) + |x~_B| |w~_B|),
//   g = K u / (1 - K u),  u = 2^-23
// (Cauchy-Schwarz on the rounding errors, the usual bound on the additions; u covers any faithful rounding), and
// the float32 sum f of the tiles is within g |x| |w| of x.w. So f lies within B of a~, with B their sum (|w~_I| <=
// |w_I| + |w_I - w~_I|) plus slack for the bias's addition, for B itself being computed in float32, and for
// products and sums that flush to zero. The row with the largest a~ - B has f >= a~ - B; a row whose a~ + B is
// below that can not be the maximum (nor tie it), so only rows with a~ + B at or above it are summed in float32.
// The norms of W's rows' parts and of their rounding errors are computed once, with the copy (pack_greedy_screen).

#include "common.h"
#include "kernels.h"

namespace aioengine_cpu {

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
namespace {

constexpr int64_t kBlock = 64;  // columns of W per block of the copy, as in the float32 copy
constexpr int kTileRows = 6;
constexpr int64_t kMaxRows = 1024;  // rows of x one call screens (a greedy step has at most max_num_seqs)
constexpr int kNorms = 6;  // |w_I|, |w_I - w~_I|, |w_B|, |w_B - w~_B|, |w~_B|, |w| for each row of W
constexpr int64_t kPrefetchSteps = 12;  // how far ahead in k the float32 pass fetches a candidate's lines

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

// v's int8 values q = v * inverse rounded to nearest, within +-127 (the copy's and x's alike).
inline __m512i quantize_int8(__m512 v, __m512 inverse) {
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inverse));
  return _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
}

// The three squared norms a bound needs of an int8 part, |v|^2, |v - s q|^2 and |s q|^2, summed lane by lane in
// double (s q exact there) over the vectors added: for W's copy each lane is a column, for x the lanes are summed
// at the end.
struct Int8Sums {
  __m512d sums[3][2] = {};  // [quantity][lanes 0-7, 8-15]

  void add(__m512 v, __m512 s, __m512i q) {
    const __m512 parts[2] = {v, s};
    __m512d halves[2][2];  // [v, s][lo, hi]
    for (int i = 0; i < 2; ++i) {
      halves[i][0] = _mm512_cvtps_pd(_mm512_castps512_ps256(parts[i]));
      halves[i][1] = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(parts[i]), 1)));
    }
    const __m512d qd[2] = {_mm512_cvtepi32_pd(_mm512_castsi512_si256(q)),
                           _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(q, 1))};
    for (int h = 0; h < 2; ++h) {
      const __m512d rounded = _mm512_mul_pd(halves[1][h], qd[h]);
      const __m512d err = _mm512_sub_pd(halves[0][h], rounded);
      sums[0][h] = _mm512_fmadd_pd(halves[0][h], halves[0][h], sums[0][h]);
      sums[1][h] = _mm512_fmadd_pd(err, err, sums[1][h]);
      sums[2][h] = _mm512_fmadd_pd(rounded, rounded, sums[2][h]);
    }
  }
  void lanes(int q, double* out) const {
    _mm512_storeu_pd(out, sums[q][0]);
    _mm512_storeu_pd(out + 8, sums[q][1]);
  }
  double total(int q) const { return _mm512_reduce_add_pd(_mm512_add_pd(sums[q][0], sums[q][1])); }
};

// A block of the copy is `steps` = quads + pairs words for each of its 64 columns ([step][column]), then the
// columns' scales s_w (as float bits), their offsets (128 times the sum of the column's int8 values) and the
// largest of each of the kNorms norms over the block's columns (float bits, the first kNorms words): quad words
// hold four int8 values (byte j: dimension order[4 s + j]), pair words two bfloat16 ones (the low half first).
struct Layout {
  int64_t quads, pairs;
  int64_t steps() const { return quads + pairs; }
  static constexpr int64_t kMetaRows = 3;
  int64_t block_words() const { return (steps() + kMetaRows) * kBlock; }
};

Layout layout_of(int64_t K, int64_t int8_dims) { return {(int8_dims + 3) / 4, (K - int8_dims + 1) / 2}; }

// acc += the sums of four products a lane, a's bytes unsigned, b's signed (VPDPBUSD). Written out: GCC 12 copied
// each accumulator around the intrinsic's tied operand and spilled six of the tile's 24 (a 1.5x slower tile).
inline void dpbusd(__m512i& acc, __m512i a, __m512i b) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b)); }

// out[r][0..63] = a~ of x's rows r (their words at x + r * ldx: quads, then pairs) against the 64 columns of one
// block (at w): the int8 part summed as integers (x's bytes offset by 128 to VPDPBUSD's unsigned operand, the
// columns' offsets taking that back out), turned into floats scaled by s_w s_x[r], then the bfloat16 part added.
template <int MR>
void screen_tile(const uint32_t* __restrict x, int64_t ldx, const uint32_t* __restrict w, Layout lay,
                 const float* __restrict sx, float* __restrict out) {
  __m512 acc[MR][4];
  if (lay.quads > 0) {
    __m512i sums[MR][4];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) sums[r][v] = _mm512_setzero_si512();
    for (int64_t q = 0; q < lay.quads; ++q) {
      __m512i wv[4];
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_si512(w + q * kBlock + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512i xr = _mm512_set1_epi32(static_cast<int>(x[r * ldx + q]));
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) dpbusd(sums[r][v], xr, wv[v]);
      }
    }
    const uint32_t* meta = w + lay.steps() * kBlock;
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const __m512 sw = _mm512_castsi512_ps(_mm512_loadu_si512(meta + 16 * v));
      const __m512i offset = _mm512_loadu_si512(meta + kBlock + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r][v], offset));
        acc[r][v] = _mm512_mul_ps(dot, _mm512_mul_ps(sw, _mm512_set1_ps(sx[r])));
      }
    }
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t p = lay.quads; p < lay.steps(); ++p) {
    __m512bh wv[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + p * kBlock + 16 * v);
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

using ScreenTile = void (*)(const uint32_t*, int64_t, const uint32_t*, Layout, const float*, float*);
constexpr ScreenTile kScreenTiles[kTileRows] = {&screen_tile<1>, &screen_tile<2>, &screen_tile<3>,
                                                &screen_tile<4>, &screen_tile<5>, &screen_tile<6>};

struct Candidate {
  int64_t column;
  float high;  // a~ + B: the most its float32 sum can be
};

// That order is a permutation of 0 .. K-1 and int8_dims within it; raises, naming the kernel, where not.
const int64_t* checked_order(const char* name, const at::Tensor& order, int64_t K, int64_t int8_dims) {
  TORCH_CHECK(order.scalar_type() == at::kLong && order.dim() == 1 && order.is_contiguous() && order.numel() == K,
              name, ": order must be a contiguous int64 tensor of the ", K, " input dimensions");
  // Up to 2^16 of them VPDPBUSD's int32 sums (at most 255 * 127 a product) cannot overflow.
  TORCH_CHECK(int8_dims >= 0 && int8_dims <= std::min<int64_t>(K, 1 << 16), name, ": int8_dims ", int8_dims,
              " is outside 0..", std::min<int64_t>(K, 1 << 16));
  const int64_t* o = order.data_ptr<int64_t>();
  std::vector<bool> seen(static_cast<size_t>(K), false);
  for (int64_t i = 0; i < K; ++i) {
    TORCH_CHECK(o[i] >= 0 && o[i] < K && !seen[o[i]], name, ": order is not a permutation of 0..", K - 1);
    seen[o[i]] = true;
  }
  return o;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> pack_greedy_screen(int64_t w_address, int64_t w_floats, int64_t N, int64_t K,
                                                      int64_t block_stride, const at::Tensor& order,
                                                      int64_t int8_dims, const c10::optional<at::Tensor>& into_packed,
                                                      const c10::optional<at::Tensor>& into_norms) {
  TORCH_CHECK(K > 0, "pack_greedy_screen: the weight has no columns");
  check_row_block_copy("pack_greedy_screen", w_address, w_floats, N, K, block_stride);
  const int64_t* dims = checked_order("pack_greedy_screen", order, K, int8_dims);
  const Layout lay = layout_of(K, int8_dims);
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  // Into the previous copy where it has this shape (a swap's rebuild then touches no fresh pages), else anew.
  const at::TensorOptions options = at::TensorOptions().device(at::kCPU);
  auto fits = [](const c10::optional<at::Tensor>& t, at::IntArrayRef shape, at::ScalarType dtype) {
    return t.has_value() && t->sizes() == shape && t->scalar_type() == dtype && t->is_contiguous() && t->is_cpu();
  };
  const std::vector<int64_t> packed_shape{blocks, lay.steps() + Layout::kMetaRows, kBlock}, norms_shape{kNorms, N};
  at::Tensor packed = fits(into_packed, packed_shape, at::kInt) ? *into_packed
                                                                : at::empty(packed_shape, options.dtype(at::kInt));
  at::Tensor norms = fits(into_norms, norms_shape, at::kFloat) ? *into_norms
                                                               : at::empty(norms_shape, options.dtype(at::kFloat));
  const float* src = reinterpret_cast<const float*>(w_address);
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  float* n = norms.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const float* block = src + blk * block_stride;  // column c's value k at block[k * 64 + c]
      uint32_t* out = dst + blk * lay.block_words();  // step s's word for column c at out[s * 64 + c]
      const int64_t ncols = std::min(kBlock, N - blk * kBlock);
      // int8: each column's largest magnitude maps to 127. Found for the block's four groups of 16 columns in one
      // pass over its rows, each row a run of 256 bytes (a pass for each group strode through memory 64 bytes in
      // 256, waiting on it for half the copy's time); each group's maximum is taken in the same order as alone.
      __m512 largest_of[kBlock / 16];
      for (__m512& l : largest_of) l = _mm512_setzero_ps();
      for (int64_t i = 0; i < int8_dims; ++i) {
        const float* row = block + dims[i] * kBlock;
        for (int64_t g = 0; g < kBlock / 16; ++g)
          largest_of[g] = _mm512_max_ps(largest_of[g],
                                        _mm512_abs_ps(_mm512_maskz_loadu_ps(Wide::mask(ncols - 16 * g), row + 16 * g)));
      }
      for (int64_t g = 0; g < kBlock / 16; ++g) {  // 16 columns at a time; those past N (and past K) as zeros
        const __mmask16 mask = Wide::mask(ncols - 16 * g);
        auto load = [&](int64_t i, int64_t count) {  // value order[i] of the 16 columns, zero past `count`
          return i < count ? _mm512_maskz_loadu_ps(mask, block + dims[i] * kBlock + 16 * g) : _mm512_setzero_ps();
        };
        const __m512 largest = largest_of[g];
        const __m512 scale = _mm512_div_ps(largest, _mm512_set1_ps(127.f));
        const __mmask16 nonzero = _mm512_cmp_ps_mask(largest, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 inverse = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(127.f), largest);
        Int8Sums int8_sums;
        __m512i total = _mm512_setzero_si512();
        for (int64_t s = 0; s < lay.quads; ++s) {
          __m512i word = _mm512_setzero_si512();
          for (int j = 0; j < 4; ++j) {
            const __m512 v = load(4 * s + j, int8_dims);
            const __m512i q = quantize_int8(v, inverse);
            int8_sums.add(v, scale, q);
            total = _mm512_add_epi32(total, q);
            word = _mm512_or_si512(word, _mm512_slli_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0xFF)), 8 * j));
          }
          _mm512_storeu_si512(out + s * kBlock + 16 * g, word);
        }
        _mm512_storeu_si512(out + lay.steps() * kBlock + 16 * g, _mm512_castps_si512(scale));
        _mm512_storeu_si512(out + (lay.steps() + 1) * kBlock + 16 * g, _mm512_slli_epi32(total, 7));
        // bfloat16: the rest of the dimensions, in pairs.
        SquareSums bf16_sums;
        for (int64_t p = 0; p < lay.pairs; ++p) {
          const __m512i re = bf16_sums.add(load(int8_dims + 2 * p, K));
          const __m512i ro = bf16_sums.add(load(int8_dims + 2 * p + 1, K));
          _mm512_storeu_si512(out + (lay.quads + p) * kBlock + 16 * g,
                              _mm512_or_si512(ro, _mm512_srli_epi32(re, 16)));  // the first value in the low half
        }
        double columns[5][16];
        int8_sums.lanes(0, columns[0]);
        int8_sums.lanes(1, columns[1]);
        for (int q = 0; q < 3; ++q) bf16_sums.lanes(q, columns[2 + q]);
        for (int64_t c = 0; c < std::min<int64_t>(16, ncols - 16 * g); ++c) {
          const int64_t row = blk * kBlock + 16 * g + c;
          n[0 * N + row] = up(std::sqrt(columns[0][c]));                   // |w_I|
          n[1 * N + row] = up(std::sqrt(columns[1][c]));                   // |w_I - w~_I|
          n[2 * N + row] = up(std::sqrt(columns[2][c]));                   // |w_B|
          n[3 * N + row] = up(std::sqrt(columns[3][c]));                   // |w_B - w~_B|
          n[4 * N + row] = up(std::sqrt(columns[4][c]));                   // |w~_B|
          n[5 * N + row] = up(std::sqrt(columns[0][c] + columns[2][c]));  // |w|
        }
      }
      float* largest_norms = reinterpret_cast<float*>(out + (lay.steps() + 2) * kBlock);
      std::fill(largest_norms, largest_norms + kBlock, 0.f);
      for (int q = 0; q < kNorms; ++q)
        for (int64_t c = 0; c < ncols; ++c) {
          const float v = n[q * N + blk * kBlock + c];
          largest_norms[q] = std::isnan(v) || std::isnan(largest_norms[q]) ? v : std::max(largest_norms[q], v);
        }
    }
  });
  return {packed, norms};
}

// The first maximum of each row of x @ W.T (+ bias) as linear_row_blocks_argmax computes it ([M] int64), or an
// empty tensor where the screen cannot answer (x not finite, too many rows, or too many rows of W left for the
// float32 pass: the caller then runs linear_row_blocks_argmax). The rows left are summed from W's float32
// row-block copy (linear_row_blocks' arguments), which the screen's copy was made from with the same order and
// int8_dims, or from `rows`, W itself, where given (the same values).
at::Tensor greedy_screen_argmax(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& norms,
                                const at::Tensor& order, int64_t int8_dims, int64_t w_address, int64_t w_floats,
                                int64_t N, int64_t block_stride, const c10::optional<at::Tensor>& bias,
                                const c10::optional<at::Tensor>& rows) {
  const float* b = checked_row_blocks("greedy_screen_argmax", x, w_address, w_floats, N, block_stride, bias);
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t* dims = checked_order("greedy_screen_argmax", order, K, int8_dims);
  const Layout lay = layout_of(K, int8_dims);
  const int64_t blocks = (N + kBlock - 1) / kBlock, steps = lay.steps();
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == blocks && packed.size(1) == steps + Layout::kMetaRows && packed.size(2) == kBlock,
              "greedy_screen_argmax: the screen's copy does not hold ", N, " rows of ", K, " columns with ",
              int8_dims, " of them in int8");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.dim() == 2 &&
                  norms.size(0) == kNorms && norms.size(1) == N,
              "greedy_screen_argmax: norms must be pack_greedy_screen's [", kNorms, ", ", N, "] float32");
  const at::Tensor none = at::empty({0}, x.options().dtype(at::kLong));
  if (M == 0 || M > kMaxRows) return none;

  // x's words (int8 quads with each row's scale, then bfloat16 pairs), and the coefficients of each row's bound,
  // [norm][row] (rows padded to whole registers with zeros: a block's bound for every row at once, sixteen rows a
  // vector).
  const float* xs = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  std::vector<uint32_t> words(static_cast<size_t>(M * steps), 0);
  std::vector<float> x_scale(M);
  const int64_t padded_rows = (M + 15) / 16 * 16;
  std::vector<float> coef(static_cast<size_t>(kNorms * padded_rows), 0.f);
  const double u = 0x1p-23, g = static_cast<double>(K) * u / (1.0 - static_cast<double>(K) * u);
  const double slack = 1.0 + 0x1p-20;
  // A row in `order`, each part zero-padded to whole registers: the int8 part's 4 * quads, then the bfloat16's.
  const int64_t int8_floats = (4 * lay.quads + 15) / 16 * 16, bf16_floats = (2 * lay.pairs + 15) / 16 * 16;
  std::vector<float> permuted(static_cast<size_t>(int8_floats + bf16_floats), 0.f);
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = xs + r * ldx;
    uint32_t* wr = words.data() + r * steps;
    for (int64_t i = 0; i < int8_dims; ++i) permuted[i] = xr[dims[i]];
    for (int64_t i = int8_dims; i < K; ++i) permuted[int8_floats + i - int8_dims] = xr[dims[i]];
    __m512 top = _mm512_setzero_ps();
    for (int64_t i = 0; i < int8_floats; i += 16)
      top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(&permuted[i])));
    const float largest = _mm512_reduce_max_ps(top);
    if (!std::isfinite(largest)) return none;
    const float scale = largest / 127.f, inverse = largest > 0.f ? 127.f / largest : 0.f;
    Int8Sums int8_sums;
    uint8_t* bytes = reinterpret_cast<uint8_t*>(wr);  // VPDPBUSD's unsigned bytes: q + 128, value i at byte i
    for (int64_t i = 0; i < int8_floats; i += 16) {
      const __m512 v = _mm512_loadu_ps(&permuted[i]);
      const __m512i q = quantize_int8(v, _mm512_set1_ps(inverse));
      int8_sums.add(v, _mm512_set1_ps(scale), q);
      _mm512_mask_cvtepi32_storeu_epi8(bytes + i, Wide::mask(4 * lay.quads - i),
                                       _mm512_add_epi32(q, _mm512_set1_epi32(128)));
    }
    x_scale[r] = scale;
    SquareSums sums;
    for (int64_t p0 = 0; p0 < 2 * lay.pairs; p0 += 16) {
      const __m512i rounded = _mm512_srli_epi32(sums.add(_mm512_loadu_ps(&permuted[int8_floats + p0])), 16);
      alignas(64) uint32_t halves[16];
      _mm512_store_si512(halves, rounded);
      for (int j = 0; j < 16 && p0 + j < 2 * lay.pairs; j += 2)
        wr[lay.quads + (p0 + j) / 2] = halves[j] | halves[j + 1] << 16;  // the first value in the low half
    }
    const double int8_whole = int8_sums.total(0), int8_error = int8_sums.total(1);
    const double int8_rounded = int8_sums.total(2);
    const double whole = int8_whole + sums.total(0), rounded_i = std::sqrt(int8_rounded) * (1.0 + 4 * u);
    if (!std::isfinite(whole) || !std::isfinite(sums.total(2))) return none;
    // B = c0 |w_I| + c1 |w_I - w~_I| + c2 |w_B| + c3 |w_B - w~_B| + c4 |w~_B| + c5 |w|, each factor rounded up.
    const float row[kNorms] = {up((std::sqrt(int8_error) + 4 * u * std::sqrt(int8_rounded) + g * rounded_i) * slack),
                               up((1.0 + g) * rounded_i * slack),
                               up(std::sqrt(sums.total(1)) * slack),
                               up(std::sqrt(sums.total(2)) * slack),
                               up(g * std::sqrt(sums.total(2)) * slack),
                               up(g * std::sqrt(whole) * slack)};
    for (int q = 0; q < kNorms; ++q) coef[q * padded_rows + r] = row[q];
  }
  const float* wn = norms.data_ptr<float>();
  // Flushed products and sums (at most 2^-126 each, K of them) and the float32 arithmetic of a~ + bias and of
  // a~ +- B (a few ulp of their size): far below these.
  const float absolute = static_cast<float>(K) * 0x1p-120f, relative = 0x1p-20f;

  const int64_t threads = at::get_num_threads();
  const ScratchFloats tiles(threads * M * kBlock), block_bounds(threads * padded_rows);
  std::vector<float> lows(static_cast<size_t>(threads * M), -std::numeric_limits<float>::infinity());
  std::vector<std::vector<Candidate>> found(static_cast<size_t>(threads * M));
  const uint32_t* wb = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  std::atomic<bool> unbounded{false};
  parallel_tasks(blocks, [&](int64_t blk, int64_t) {
    const int64_t thread = at::get_thread_num(), c0 = blk * kBlock, ncols = std::min(kBlock, N - c0);
    float* out = tiles.data + thread * M * kBlock;
    const int64_t row_tiles = (M + kTileRows - 1) / kTileRows;
    for (int64_t t = 0, r = 0; t < row_tiles; ++t) {
      const int64_t mr = (M - r + (row_tiles - t) - 1) / (row_tiles - t);
      kScreenTiles[mr - 1](words.data() + r * steps, steps, wb + blk * lay.block_words(), lay, x_scale.data() + r,
                           out + r * kBlock);
      r += mr;
    }
    const float* largest_norms = reinterpret_cast<const float*>(wb + blk * lay.block_words() + (steps + 2) * kBlock);
    float* bounds = block_bounds.data + thread * padded_rows;  // each row's bound with the block's largest norms
    for (int64_t r = 0; r < padded_rows; r += 16) {
      __m512 bound = _mm512_setzero_ps();
      for (int q = 0; q < kNorms; ++q)
        bound = _mm512_fmadd_ps(_mm512_loadu_ps(&coef[q * padded_rows + r]),
                                _mm512_set1_ps(largest_norms[q]), bound);
      _mm512_storeu_ps(bounds + r, bound);
    }
    for (int64_t r = 0; r < M; ++r) {
      float& low_best = lows[thread * M + r];
      std::vector<Candidate>& list = found[thread * M + r];
      float* row = out + r * kBlock;
      // First the block as a whole, bounded with its largest norms: most blocks hold no row near the best, and
      // where even their largest a~ plus that bound is below the floor, no column is a candidate nor can raise the
      // floor (a~ + B grows with a~: its |a~| term has a factor under 1). NaN anywhere, or a bound that is not
      // finite, takes the column-by-column path, which declines it.
      __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __mmask16 nan = 0;
      for (int v = 0; v * 16 < ncols; ++v) {
        const __mmask16 mask = Wide::mask(ncols - 16 * v);
        __m512 a = _mm512_loadu_ps(row + 16 * v);
        if (b != nullptr) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(mask, b + c0 + 16 * v));
        nan |= _mm512_mask_cmp_ps_mask(mask, a, a, _CMP_UNORD_Q);
        top = _mm512_mask_max_ps(top, mask, top, a);
      }
      float block_bound = bounds[r];
      const float block_top = _mm512_reduce_max_ps(top);
      block_bound += relative * (std::abs(block_top) + block_bound) + block_bound * relative + absolute;
      if (nan == 0 && std::isfinite(block_top + block_bound) && block_top + block_bound < low_best) {
        continue;  // its a~ - B are below the floor too
      }
      __m512 highs[4];
      for (int v = 0; v * 16 < ncols; ++v) {
        const __mmask16 mask = Wide::mask(ncols - 16 * v);
        __m512 a = _mm512_loadu_ps(row + 16 * v);
        if (b != nullptr) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(mask, b + c0 + 16 * v));
        __m512 bound = _mm512_setzero_ps();
        for (int q = 0; q < kNorms; ++q)
          bound = _mm512_fmadd_ps(_mm512_set1_ps(coef[q * padded_rows + r]),
                                  _mm512_maskz_loadu_ps(mask, wn + q * N + c0 + 16 * v),
                                  bound);
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
  // The candidates' float32 values from W's rows where the caller has them ([N, K], each row one run of memory:
  // K / 16 cache lines a candidate), else from the row-block copy (a line for each k of a candidate).
  const bool by_rows = rows.has_value();
  if (by_rows) {
    TORCH_CHECK(rows->scalar_type() == at::kFloat && rows->is_contiguous() && rows->dim() == 2 &&
                    rows->size(0) == N && rows->size(1) == K && rows->device().is_cpu(),
                "greedy_screen_argmax: rows must be W as a contiguous float32 [", N, ", ", K, "] CPU tensor");
  }
  const float* w = by_rows ? rows->data_ptr<float>() : reinterpret_cast<const float*>(w_address);
  const int64_t k_step = by_rows ? 1 : kBlock;
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
        offsets[l] = by_rows ? c * K : (c / kBlock) * block_stride + c % kBlock;
      }
      const __m512i idx = _mm512_loadu_si512(offsets);
      __m256 acc = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        // From the row-block copy each k of a candidate is a line of its own, a stride of 64 floats on: the
        // lines kPrefetchSteps on are asked for now (the gathers alone left most of them to wait on memory).
        if (!by_rows && k + kPrefetchSteps < K)
          for (int l = 0; l < lanes; ++l) __builtin_prefetch(w + (k + kPrefetchSteps) * kBlock + offsets[l], 0, 3);
        const __m256 wv = _mm512_i64gather_ps(idx, w + k * k_step, 4);
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
