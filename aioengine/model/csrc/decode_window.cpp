// A greedy decode window in one call (CPU, float32, AVX-512 or AVX2 builds): the steps of a window, each the
// embedding of its rows' tokens, decoder_layers, the final norm and the lm_head's first maximum (the greedy
// screen where given, else the float32 GEMM's), each step's tokens the next one's input at the next position.
// The same kernels, with the same arguments, as the model runs step by step from Python; what the window saves
// is the Python between them: on the tiny model ~0.6 ms of a ~4 ms step (input tensors, sampling's bookkeeping,
// the interpreter's code cold after each kernel), the second thread idle meanwhile.

#include "common.h"
#include "kernels.h"

namespace aioengine_cpu {

#if defined(AIOENGINE_WIDE)

// tokens, positions, steps: [B] int64 (row b's first input token, its position, the steps it runs at most: >= 1);
// block_tables [B, W] int64, each row's blocks covering every position the row writes; embedding [V, H];
// stop_ids [B, S] int64 (-1 pads): a row that picks one of its own ends there (the engine ends the sequence on it
// and would drop the row's later tokens); the screen's arguments (screen_packed .. screen_rows) as
// greedy_screen_argmax takes them, all or none. Returns [B, max steps] int64: row b's token of each step it runs,
// -1 after its last.
at::Tensor greedy_decode_window(
    const LayerStack& stack, const std::vector<at::Tensor>& kv_caches, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& embedding, const at::Tensor& final_norm, double final_eps, const PackedLinear& head,
    const c10::optional<at::Tensor>& head_bias, const at::Tensor& tokens, const at::Tensor& positions,
    const at::Tensor& block_tables, const at::Tensor& steps, int64_t block_size,
    const c10::optional<at::Tensor>& stop_ids, const c10::optional<at::Tensor>& screen_packed,
    const c10::optional<at::Tensor>& screen_norms, const c10::optional<at::Tensor>& screen_order,
    int64_t screen_int8_dims, const c10::optional<at::Tensor>& screen_rows) {
  const int64_t B = tokens.numel();
  for (const at::Tensor* t : {&tokens, &positions, &steps}) {
    TORCH_CHECK(t->dim() == 1 && t->numel() == B && t->scalar_type() == at::kLong && t->device().is_cpu(),
                "greedy_decode_window: tokens, positions and steps must be [", B, "] int64 CPU tensors");
  }
  TORCH_CHECK(B > 0 && block_tables.dim() == 2 && block_tables.size(0) == B &&
                  block_tables.scalar_type() == at::kLong && block_tables.device().is_cpu(),
              "greedy_decode_window: block_tables must be [", B, ", W] int64 on the CPU");
  TORCH_CHECK(embedding.dim() == 2 && embedding.scalar_type() == at::kFloat && embedding.is_contiguous(),
              "greedy_decode_window: the embedding must be a contiguous float32 [vocab, hidden]");
  TORCH_CHECK(block_size > 0, "greedy_decode_window: block_size must be positive");
  TORCH_CHECK(!stop_ids.has_value() || (stop_ids->dim() == 2 && stop_ids->size(0) == B &&
                                        stop_ids->scalar_type() == at::kLong && stop_ids->device().is_cpu()),
              "greedy_decode_window: stop_ids must be [", B, ", S] int64 on the CPU");
  const at::Tensor stops = stop_ids.has_value() ? stop_ids->contiguous() : at::empty({B, 0}, tokens.options());
  const int64_t S = stops.size(1);
  const int64_t* stp = stops.data_ptr<int64_t>();
  TORCH_CHECK(screen_packed.has_value() == screen_norms.has_value() &&
                  screen_packed.has_value() == screen_order.has_value(),
              "greedy_decode_window: the screen's packed copy, norms and order come together");
#if !(defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__))
  TORCH_CHECK(!screen_packed.has_value(), "greedy_decode_window: this build has no greedy screen");
#endif
  const int64_t W = block_tables.size(1), vocab = embedding.size(0);
  at::Tensor tables = block_tables.clone(at::MemoryFormat::Contiguous);  // compacted as rows leave
  const at::Tensor steps_of = steps.contiguous();  // held: st points into it
  const int64_t* st = steps_of.data_ptr<int64_t>();
  int64_t most = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(st[b] >= 1, "greedy_decode_window: row ", b, " runs ", st[b], " steps");
    most = std::max(most, st[b]);
  }
  at::Tensor out = at::full({B, most}, -1, tokens.options());
  int64_t* op = out.data_ptr<int64_t>();

  // The rows still running, compacted in order: their row in `out`, token, position, and block table.
  std::vector<int64_t> rows(static_cast<size_t>(B));
  std::vector<char> stopped(static_cast<size_t>(B), 0);  // by row in `out`
  for (int64_t b = 0; b < B; ++b) rows[b] = b;
  at::Tensor tok = tokens.clone(at::MemoryFormat::Contiguous), pos = positions.clone(at::MemoryFormat::Contiguous);
  at::Tensor slots = at::empty({B}, tokens.options()), lens = at::empty({B}, tokens.options());
  for (int64_t i = 0; i < most; ++i) {
    int64_t n = 0;  // rows that run step i, moved to the front
    int64_t* tp = tok.data_ptr<int64_t>();
    int64_t* pp = pos.data_ptr<int64_t>();
    int64_t* tb = tables.data_ptr<int64_t>();
    for (int64_t k = 0; k < static_cast<int64_t>(rows.size()); ++k) {
      if (st[rows[k]] <= i || stopped[rows[k]]) continue;
      if (n != k) {
        rows[n] = rows[k], tp[n] = tp[k], pp[n] = pp[k];
        std::memmove(tb + n * W, tb + k * W, static_cast<size_t>(W) * sizeof(int64_t));
      }
      ++n;
    }
    rows.resize(static_cast<size_t>(n));
    if (n == 0) break;  // every row stopped
    int64_t* sp = slots.data_ptr<int64_t>();
    int64_t* lp = lens.data_ptr<int64_t>();
    for (int64_t k = 0; k < n; ++k) {
      TORCH_CHECK(tp[k] >= 0 && tp[k] < vocab, "greedy_decode_window: token ", tp[k], " outside the vocabulary of ",
                  vocab);
      const int64_t block = pp[k] / block_size;
      TORCH_CHECK(pp[k] >= 0 && block < W && tb[k * W + block] >= 0, "greedy_decode_window: position ", pp[k],
                  " of row ", rows[k], " outside its block table");
      sp[k] = tb[k * W + block] * block_size + pp[k] % block_size;
      lp[k] = pp[k] + 1;
    }
    const at::Tensor live = tok.narrow(0, 0, n), where = pos.narrow(0, 0, n);
    const at::Tensor table = tables.narrow(0, 0, n), slot = slots.narrow(0, 0, n), len = lens.narrow(0, 0, n);
    auto [x, stream] = decoder_layers(stack, embedding.index_select(0, live), c10::nullopt, kv_caches, where, cos, sin,
                                      slot, n, table, len, {}, c10::nullopt);
    const at::Tensor h = add_rms_norm(x, stream, final_norm, final_eps);
    const auto& [address, floats, out_features, block_stride] = head;
    at::Tensor next;
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    if (screen_packed.has_value()) {
      next = greedy_screen_argmax(h, *screen_packed, *screen_norms, *screen_order, screen_int8_dims, address, floats,
                                  out_features, block_stride, head_bias, screen_rows);
    }
#endif
    if (!next.defined() || next.numel() != n) {  // no screen, or one that cannot vouch for its answer
      next = linear_row_blocks_argmax(h, address, floats, out_features, block_stride, head_bias);
    }
    const int64_t* np = next.data_ptr<int64_t>();
    for (int64_t k = 0; k < n; ++k) {
      op[rows[k] * most + i] = np[k];
      tp[k] = np[k];
      pp[k] += 1;
      const int64_t* own = stp + rows[k] * S;
      stopped[rows[k]] = std::find(own, own + S, np[k]) != own + S;
    }
  }
  return out;
}

#endif

}  // namespace aioengine_cpu
