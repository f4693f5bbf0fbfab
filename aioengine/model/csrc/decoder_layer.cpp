// A Llama-family decoder layer in one call, and a run of layers in one (CPU, float32, AVX-512 or AVX2 builds):
// the same kernels the layer's modules call one by one from Python (norms, the row-block GEMMs, rotary, the
// paged attention kernels, SiLU-and-mul), with the KV write (beside the rotary, one pass) and the views between
// them done here. A decode step of the real model pays Python and torch's dispatch some 40 times a layer
// otherwise, 10-15% of its time on this CPU.

#include "common.h"
#include "kernels.h"

namespace aioengine_cpu {

#if defined(AIOENGINE_WIDE)
namespace {

at::Tensor project(const at::Tensor& x, const PackedLinear& w, const c10::optional<at::Tensor>& bias) {
  const auto& [address, floats, out_features, block_stride] = w;
  return linear_row_blocks(x, address, floats, out_features, block_stride, bias);
}

// The rotary embedding of q [T, H, D] in place and of k [T, Hkv, D] into the cache [2, blocks, block_size, Hkv, D],
// with v beside it, for every token whose slot is >= 0 (a negative slot is a padded token: its q is rotated, it
// writes nothing); tokens and heads at any stride, D contiguous. One pass over the tokens on every thread, where
// rotary_inplace and then a copy on one thread wrote the cache (k itself is left as it came: nothing reads it after).
void rotary_write_kv(at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                     const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_cache,
                     const at::Tensor& slot_mapping) {
  const int64_t T = k.size(0), H = q.size(1), Hkv = k.size(1), D = k.size(2), half = D / 2;
  TORCH_CHECK(q.size(0) == T && q.size(2) == D && q.stride(2) == 1 && k.stride(2) == 1 && v.sizes() == k.sizes() &&
                  v.stride(2) == 1, "decoder_layer: q, k and v must be [T, heads, D] with D contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kFloat &&
                  kv_cache.size(0) == 2 && kv_cache.size(3) == Hkv && kv_cache.size(4) == D,
              "decoder_layer: kv_cache must be a contiguous float32 [2, blocks, block_size, ", Hkv, ", ", D, "]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T,
              "decoder_layer: slot_mapping must hold one int64 slot per token");
  const at::Tensor pos = checked_rotary_positions("decoder_layer", positions, T, D, cos, sin);
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] < num_slots, "decoder_layer: slot ", sp[t], " of token ", t, " outside the cache's ",
                num_slots);
  }
  float* kc = kv_cache.data_ptr<float>();
  float* vc = kc + num_slots * Hkv * D;
  float* qp = q.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pp[t] * D;
      const float* s = snp + pp[t] * D;
      for (int64_t h = 0; h < H; ++h) {
        float* qh = qp + t * q.stride(0) + h * q.stride(1);
        rotate_head(qh, qh, c, s, half);
      }
      if (sp[t] < 0) continue;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t dst = (sp[t] * Hkv + h) * D;
        rotate_head(kp + t * k.stride(0) + h * k.stride(1), kc + dst, c, s, half);
        std::memcpy(vc + dst, vp + t * v.stride(0) + h * v.stride(1), static_cast<size_t>(D) * sizeof(float));
      }
    }
  });
}

// [T, heads, D] at `offset` floats into each row of the fused projection's output qkv [T, row].
at::Tensor heads_of(const at::Tensor& qkv, int64_t heads, int64_t D, int64_t offset) {
  return qkv.as_strided({qkv.size(0), heads, D}, {qkv.size(1), D, 1}, qkv.storage_offset() + offset);
}

}  // namespace

// x [T, hidden]: the previous layer's MLP output, not yet added into `residual` (the residual stream, updated
// in place), or for the first layer the embeddings with no residual (x becomes the stream). The attention
// metadata is the step's: `slot_mapping` [T]; the first `num_decodes` tokens are decode rows (the decode
// kernel's block tables and context lengths); then the prefill chunks (token start, tokens, start position,
// block ids). Returns the layer's MLP output and the residual stream, as LlamaDecoderLayer.forward does. With
// `keep` (row indices, the model's last layer) every token still writes its K and V, but the rows after the
// attention (the o projection, the residual add, the MLP) are only those of `keep`, in its order, and so are
// the two results: a prompt's other tokens need nothing past the last layer's K and V.
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& input_norm, double input_eps,
    const at::Tensor& post_norm, double post_eps, const PackedLinear& qkv, const c10::optional<at::Tensor>& qkv_bias,
    const PackedLinear& o, const c10::optional<at::Tensor>& o_bias, const PackedLinear& gate_up,
    const PackedLinear& down, const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
    double qk_eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
    int64_t num_decodes, const c10::optional<at::Tensor>& decode_block_tables,
    const c10::optional<at::Tensor>& decode_context_lens, const std::vector<PrefillSpan>& prefills, double scale,
    const c10::optional<at::Tensor>& keep) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "decoder_layer: x must be a contiguous float32 [tokens, hidden] CPU tensor");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decoder_layer: q_norm and k_norm come together");
  const int64_t T = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(num_decodes >= 0 && num_decodes <= T, "decoder_layer: ", num_decodes, " decode rows of ", T, " tokens");
  at::Tensor stream = residual.has_value() ? *residual : x;
  at::Tensor h = residual.has_value() ? add_rms_norm(x, stream, input_norm, input_eps)
                                      : rms_norm(x, input_norm, input_eps);

  const at::Tensor fused = project(h, qkv, qkv_bias);
  TORCH_CHECK(fused.size(1) == q_size + 2 * kv_size, "decoder_layer: the qkv projection has ", fused.size(1),
              " outputs, the heads need ", q_size + 2 * kv_size);
  at::Tensor q = heads_of(fused, num_heads, head_dim, 0);
  at::Tensor k = heads_of(fused, num_kv_heads, head_dim, q_size);
  const at::Tensor v = heads_of(fused, num_kv_heads, head_dim, q_size + kv_size);
  if (q_norm.has_value()) {  // Qwen3: RMSNorm of each head before rotary (new contiguous tensors)
    q = rms_norm(q, *q_norm, qk_eps);
    k = rms_norm(k, *k_norm, qk_eps);
  }
  rotary_write_kv(q, k, v, positions, cos, sin, kv_cache, slot_mapping);

  at::Tensor attn = at::empty({T, num_heads, head_dim}, x.options());
  if (num_decodes > 0) {
    TORCH_CHECK(decode_block_tables.has_value() && decode_context_lens.has_value(),
                "decoder_layer: decode rows need block tables and context lengths");
    at::Tensor out = attn.narrow(0, 0, num_decodes);
    paged_decode_attention(q.narrow(0, 0, num_decodes), kv_cache, *decode_block_tables, *decode_context_lens, scale,
                           out);
  }
  for (const auto& [start, n, start_pos, block_ids] : prefills) {
    TORCH_CHECK(start >= num_decodes && n > 0 && start + n <= T, "decoder_layer: a prefill chunk of ", n,
                " tokens at ", start, " outside tokens ", num_decodes, "..", T);
    at::Tensor out = attn.narrow(0, start, n);
    paged_prefill_attention(q.narrow(0, start, n), kv_cache, block_ids, start_pos, scale, out);
  }

  at::Tensor rows = attn.view({T, q_size});
  if (keep.has_value()) {
    TORCH_CHECK(keep->dim() == 1 && keep->scalar_type() == at::kLong, "decoder_layer: keep must be int64 row indices");
    rows = rows.index_select(0, *keep);
    stream = stream.index_select(0, *keep);
  }
  h = add_rms_norm(project(rows, o, o_bias), stream, post_norm, post_eps);
  return {project(silu_and_mul(project(h, gate_up, c10::nullopt)), down, c10::nullopt), stream};
}

// Layers in turn, each one decoder_layer call over its own cache (kv_caches[i] for stack.layers[i]), `keep` for the
// last alone: the loop the model ran in Python, where a decode step of the real model paid ~65 us between two of
// its 30 layers (the calls' arguments, the modules' frames) while the second thread waited.
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const LayerStack& stack, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
    const std::vector<at::Tensor>& kv_caches, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& slot_mapping, int64_t num_decodes,
    const c10::optional<at::Tensor>& decode_block_tables, const c10::optional<at::Tensor>& decode_context_lens,
    const std::vector<PrefillSpan>& prefills, const c10::optional<at::Tensor>& keep) {
  const size_t n = stack.layers.size();
  TORCH_CHECK(n > 0 && kv_caches.size() == n, "decoder_layers: ", kv_caches.size(), " caches for ", n, " layers");
  std::tuple<at::Tensor, at::Tensor> out{x, residual.has_value() ? *residual : at::Tensor()};
  for (size_t i = 0; i < n; ++i) {
    const auto& [in_norm, in_eps, post_norm, post_eps, qkv, qkv_bias, o, o_bias, gate_up, down, q_norm, k_norm, qk_eps,
                 heads, kv_heads, head_dim, scale] = stack.layers[i];
    at::Tensor cache = kv_caches[i];
    const c10::optional<at::Tensor> stream =
        i > 0 || residual.has_value() ? c10::optional<at::Tensor>(std::get<1>(out)) : c10::nullopt;
    out = decoder_layer(std::get<0>(out), stream, in_norm, in_eps, post_norm, post_eps, qkv, qkv_bias, o, o_bias,
                        gate_up, down, q_norm, k_norm, qk_eps, heads, kv_heads, head_dim, positions, cos, sin, cache,
                        slot_mapping, num_decodes, decode_block_tables, decode_context_lens, prefills, scale,
                        i + 1 == n ? keep : c10::nullopt);
  }
  return out;
}
#endif

}  // namespace aioengine_cpu
