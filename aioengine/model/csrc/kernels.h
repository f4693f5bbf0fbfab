// The kernels the Python module exposes (module.cpp), one definition each in the files beside it.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

// Builds with a wide FMA register (common.h's Wide): AVX-512 (16 floats) or AVX2 with FMA (8). They have the
// row-block GEMM (packed_linear.cpp; its tile 6 rows x a whole 64-column block, or 6 x 16, four across a block),
// the prefill attention kernel and the one-call layer.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define AIOENGINE_WIDE 1
#endif

namespace aioengine_cpu {

// attention.cpp
void paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, at::Tensor& out);

// prefill_attention.cpp
#if defined(AIOENGINE_WIDE)
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_ids,
                             int64_t start, double scale, at::Tensor& out);
#endif

// elementwise.cpp
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
// The positions, contiguous, checked against the rotary tables for `kernel` (rotary_inplace, decoder_layer).
at::Tensor checked_rotary_positions(const char* kernel, const at::Tensor& positions, int64_t T, int64_t D,
                                    const at::Tensor& cos, const at::Tensor& sin);
void rotary_inplace(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);

// packed_weights.cpp
bool pack_rows(const at::Tensor& src, int64_t row_offset, int64_t dst_address, int64_t dst_floats, int64_t block,
               int64_t block_stride, const c10::optional<at::Tensor>& plain);
bool copy_weight(at::Tensor& dst, const at::Tensor& src);
bool row_blocks_equal(const at::Tensor& src, int64_t dst_address, int64_t dst_floats, int64_t block,
                      int64_t block_stride);

// packed_linear.cpp
#if defined(AIOENGINE_WIDE)
at::Tensor linear_row_blocks(const at::Tensor& x, int64_t w_address, int64_t w_floats, int64_t N,
                             int64_t block_stride, const c10::optional<at::Tensor>& bias);
at::Tensor linear_row_blocks_argmax(const at::Tensor& x, int64_t w_address, int64_t w_floats, int64_t N,
                                    int64_t block_stride, const c10::optional<at::Tensor>& bias);
// That W's row-block copy (N rows of K columns in blocks of 64 at block_stride) fits in its w_floats; raises,
// naming the kernel, where not. Also pack_greedy_screen's check.
void check_row_block_copy(const char* name, int64_t w_address, int64_t w_floats, int64_t N, int64_t K,
                          int64_t block_stride);
// x's checks for those and greedy_screen_argmax, with the copy's; the bias's floats or null.
const float* checked_row_blocks(const char* name, const at::Tensor& x, int64_t w_address, int64_t w_floats, int64_t N,
                                int64_t block_stride, const c10::optional<at::Tensor>& bias);
#endif

// greedy_screen.cpp
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
std::tuple<at::Tensor, at::Tensor> pack_greedy_screen(int64_t w_address, int64_t w_floats, int64_t N, int64_t K,
                                                      int64_t block_stride, const at::Tensor& order,
                                                      int64_t int8_dims, const c10::optional<at::Tensor>& into_packed,
                                                      const c10::optional<at::Tensor>& into_norms);
at::Tensor greedy_screen_argmax(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& norms,
                                const at::Tensor& order, int64_t int8_dims, int64_t w_address, int64_t w_floats,
                                int64_t N, int64_t block_stride, const c10::optional<at::Tensor>& bias,
                                const c10::optional<at::Tensor>& rows);
#endif

// decoder_layer.cpp
#if defined(AIOENGINE_WIDE)
using PackedLinear = std::tuple<int64_t, int64_t, int64_t, int64_t>;  // address, floats, out_features, block_stride
using PrefillSpan = std::tuple<int64_t, int64_t, int64_t, at::Tensor>;  // token start, tokens, start position, blocks
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& input_norm, double input_eps,
    const at::Tensor& post_norm, double post_eps, const PackedLinear& qkv, const c10::optional<at::Tensor>& qkv_bias,
    const PackedLinear& o, const c10::optional<at::Tensor>& o_bias, const PackedLinear& gate_up,
    const PackedLinear& down, const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
    double qk_eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
    int64_t num_decodes, const c10::optional<at::Tensor>& decode_block_tables,
    const c10::optional<at::Tensor>& decode_context_lens, const std::vector<PrefillSpan>& prefills, double scale,
    const c10::optional<at::Tensor>& keep);
// One layer's arguments to decoder_layer besides the step's: input_norm, input_eps, post_norm, post_eps, qkv,
// qkv_bias, o, o_bias, gate_up, down, q_norm, k_norm, qk_eps, num_heads, num_kv_heads, head_dim and the
// attention's scale.
using LayerWeights = std::tuple<at::Tensor, double, at::Tensor, double, PackedLinear, c10::optional<at::Tensor>,
                                PackedLinear, c10::optional<at::Tensor>, PackedLinear, PackedLinear,
                                c10::optional<at::Tensor>, c10::optional<at::Tensor>, double, int64_t, int64_t, int64_t,
                                double>;
// A run of consecutive layers' arguments, converted from Python once (LlamaForCausalLM keeps it while no layer's
// arguments change) instead of at every step.
struct LayerStack {
  explicit LayerStack(std::vector<LayerWeights> layers) : layers(std::move(layers)) {}
  std::vector<LayerWeights> layers;
};
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const LayerStack& stack, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
    const std::vector<at::Tensor>& kv_caches, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& slot_mapping, int64_t num_decodes,
    const c10::optional<at::Tensor>& decode_block_tables, const c10::optional<at::Tensor>& decode_context_lens,
    const std::vector<PrefillSpan>& prefills, const c10::optional<at::Tensor>& keep);

// decode_window.cpp
at::Tensor greedy_decode_window(
    const LayerStack& stack, const std::vector<at::Tensor>& kv_caches, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& embedding, const at::Tensor& final_norm, double final_eps, const PackedLinear& head,
    const c10::optional<at::Tensor>& head_bias, const at::Tensor& tokens, const at::Tensor& positions,
    const at::Tensor& block_tables, const at::Tensor& steps, int64_t block_size,
    const c10::optional<at::Tensor>& stop_ids, const c10::optional<at::Tensor>& screen_packed,
    const c10::optional<at::Tensor>& screen_norms, const c10::optional<at::Tensor>& screen_order,
    int64_t screen_int8_dims, const c10::optional<at::Tensor>& screen_rows);
#endif

}  // namespace aioengine_cpu
