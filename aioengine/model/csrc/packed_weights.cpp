// Weights written and checked: a swapped-in linear weight rewritten into its oneDNN-reordered copy in place
// (pack_rows), any other weight copied past the caches (copy_weight), both telling whether every value was
// finite; and the check that a copy holds a weight under pack_rows' layout (row_blocks_equal), which
// linear_row_blocks (packed_linear.cpp) needs of a copy before it reads one.

#include "common.h"
#include "kernels.h"

namespace aioengine_cpu {

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

// Whether p[0, n) holds no NaN and no Inf (an exponent of all ones): an integer test the compiler vectorises.
// Run over data just copied, so it reads the caches, not memory.
inline bool span_finite(const float* p, int64_t n) {
  uint32_t special = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, p + i, sizeof(bits));
    special |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return special == 0;
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
// Returns whether every value of src is finite, read from each strip while it is in cache: a streamed weight
// is checked in the pass that writes it, not in one more read from memory.
bool pack_rows(const at::Tensor& src, int64_t row_offset, int64_t dst_address, int64_t dst_floats, int64_t block,
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
  // streamed whole lines skip that read (pack_rows 13-20% faster here).
  const bool whole_lines = block % 16 == 0 && block_stride % 16 == 0 && dst_address % 64 == 0;
#else
  const bool whole_lines = false;
#endif
  const int64_t strip_rows = whole_lines ? 16 : 8;
  // Strips aligned to their height (so none crosses a block); a partial strip at either end.
  const int64_t first = row_offset / strip_rows, last = (row_offset + R + strip_rows - 1) / strip_rows;
  std::atomic<bool> finite{true};
  at::parallel_for(first, last, 64 / strip_rows, [&](int64_t begin, int64_t end) {
    bool mine = true;
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
      mine = mine && span_finite(rows, (o1 - o0) * I);
    }
#if defined(__AVX512F__)
    _mm_sfence();  // the streamed stores are weakly ordered: done before anyone reads the copy
#endif
    if (!mine) finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
}

// dst = src for two contiguous float32 tensors of one size (a weight and a checkpoint tensor), in chunks over
// the threads, the aligned middle of each stored past the caches (a swap writes far more than they hold; a
// store of part of a line first reads it in). Returns whether every value is finite, read from each chunk
// while it is in cache.
bool copy_weight(at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && dst.scalar_type() == at::kFloat &&
                  src.scalar_type() == at::kFloat && dst.is_contiguous() && src.is_contiguous() &&
                  dst.numel() == src.numel(),
              "copy_weight: dst and src must be contiguous float32 CPU tensors of one size");
  TORCH_CHECK(dst.data_ptr<float>() != src.data_ptr<float>(), "copy_weight: dst is src");
  float* out = dst.data_ptr<float>();
  const float* in = src.data_ptr<float>();
  constexpr int64_t kChunk = 16384;  // 64 KiB: in L2 when its check reads it back
  std::atomic<bool> finite{true};
  at::parallel_for(0, (src.numel() + kChunk - 1) / kChunk, 4, [&](int64_t begin, int64_t end) {
    bool mine = true;
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t at = chunk * kChunk, n = std::min(kChunk, src.numel() - at);
      copy_past_caches(out + at, in + at, n);
      mine = mine && span_finite(in + at, n);
    }
#if defined(__AVX512F__)
    _mm_sfence();
#endif
    if (!mine) finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
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

}  // namespace aioengine_cpu
