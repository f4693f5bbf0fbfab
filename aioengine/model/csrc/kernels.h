// The kernels the Python module exposes (module.cpp), one definition each in the files beside it.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace aioengine_cpu {

// attention.cpp
void paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, at::Tensor& out);
#if defined(__AVX512F__)
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_ids,
                             int64_t start, double scale, at::Tensor& out);
#endif

// elementwise.cpp
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_inplace(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);

// packed_linear.cpp
void pack_rows(const at::Tensor& src, int64_t row_offset, int64_t dst_address, int64_t dst_floats, int64_t block,
               int64_t block_stride, const c10::optional<at::Tensor>& plain);
bool row_blocks_equal(const at::Tensor& src, int64_t dst_address, int64_t dst_floats, int64_t block,
                      int64_t block_stride);
#if defined(__AVX512F__)
at::Tensor linear_row_blocks(const at::Tensor& x, int64_t w_address, int64_t w_floats, int64_t N,
                             int64_t block_stride, const c10::optional<at::Tensor>& bias);
#endif

}  // namespace aioengine_cpu
