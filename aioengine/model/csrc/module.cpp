// aioengine's CPU kernels, float32:
// - paged decode attention: one query token per row, K and V read in place from the paged cache
//   through each row's block table (no gathered copy of the context);
// - argmax_rows: greedy sampling's argmax;
// - rms_norm, rotary_inplace, silu_and_mul: the elementwise parts of a Llama layer, one pass each
//   instead of 5-12 torch ops (on CPU every op costs microseconds of dispatch);
// - pack_rows: a swapped-in linear weight written into its oneDNN-reordered copy in place; copy_weight: any
//   other weight written past the caches; both check the values for NaN and Inf as they go;
// - linear_row_blocks: x @ W.T (+ bias) read straight from that copy, for the few rows of a decode step;
//   linear_row_blocks_argmax: the first maximum of each of its rows, for greedy steps over an lm_head
//   (AVX-512 and AVX2 builds), and row_blocks_equal, which checks that a copy is laid out as it assumes;
// - pack_greedy_screen, greedy_screen_argmax: greedy over an lm_head from an int8 and bfloat16 copy of its weight,
//   exact (the float32 GEMM's argmax, bit for bit; AVX-512 builds with AVX512-BF16 and AVX512-VNNI);
// - paged prefill attention: one prompt chunk, causal, over its context in the paged cache (AVX-512 and AVX2
//   builds);
// - decoder_layers: Llama-family decoder layers from the kernels above, a run of them in one call (AVX-512 and
//   AVX2 builds); greedy_decode_window: a decode window's greedy steps in one call, built on it.
//
// This file binds them for Python; attention.cpp, prefill_attention.cpp, elementwise.cpp, packed_weights.cpp,
// packed_linear.cpp, greedy_screen.cpp, decoder_layer.cpp and decode_window.cpp hold them, common.h their shared
// helpers. Built on first use by aioengine/model/cpu_kernels.py (torch.utils.cpp_extension); the plain torch paths
// (attention.py, layers.py, linear.py, torch.argmax) compute the same things and are what these are tested
// against.

#include <pybind11/stl.h>
#include <torch/extension.h>

#include "kernels.h"

// Every kernel releases the GIL while it runs, as torch's own ops do: it touches no Python object,
// and the engine's event loop (another thread of the same process) must keep running meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace aioengine_cpu;
  using release_gil = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU, float32), in place into out",
        release_gil());
  m.def("argmax_rows", &argmax_rows, "First index of each row's maximum (CPU, float32)", release_gil());
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (CPU, float32)", release_gil());
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm of residual (CPU, float32)",
        release_gil());
  m.def("rotary_inplace", &rotary_inplace, "Rotate-half rotary embedding of q and k, in place (CPU, float32)",
        release_gil());
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :I]) * x[:, I:] (CPU, float32)", release_gil());
  m.def("pack_rows", &pack_rows, "Rows of a linear weight into its oneDNN-reordered copy in place, and optionally "
        "into the plain weight; whether every value was finite (CPU, float32)", py::arg("src"), py::arg("row_offset"),
        py::arg("dst_address"), py::arg("dst_floats"), py::arg("block"), py::arg("block_stride"),
        py::arg("plain") = py::none(), release_gil());
  m.def("copy_weight", &copy_weight, "dst = src past the caches; whether every value was finite (CPU, float32)",
        py::arg("dst"), py::arg("src"), release_gil());
  m.def("row_blocks_equal", &row_blocks_equal, "Whether a oneDNN-reordered copy holds the weight under pack_rows' "
        "layout, value for value (CPU, float32)", py::arg("src"), py::arg("dst_address"), py::arg("dst_floats"),
        py::arg("block"), py::arg("block_stride"), release_gil());
#if defined(AIOENGINE_WIDE)
  m.def("linear_row_blocks", &linear_row_blocks, "x @ W.T (+ bias) from W's oneDNN-reordered copy in 64-row blocks "
        "(CPU, float32, AVX-512 or AVX2)", py::arg("x"), py::arg("w_address"), py::arg("w_floats"),
        py::arg("out_features"), py::arg("block_stride"), py::arg("bias") = py::none(), release_gil());
  m.def("linear_row_blocks_argmax", &linear_row_blocks_argmax, "The first maximum of each row of x @ W.T (+ bias), "
        "the output never written: greedy over an lm_head (CPU, float32, AVX-512 or AVX2)", py::arg("x"),
        py::arg("w_address"), py::arg("w_floats"), py::arg("out_features"), py::arg("block_stride"),
        py::arg("bias") = py::none(), release_gil());
  // Local to this module: another build of these kernels loaded in the same process (an AVX2 build beside the
  // AVX-512 one, a rebuilt copy) registers its own.
  py::class_<LayerStack>(m, "LayerStack", py::module_local(), "Consecutive decoder layers' arguments for "
                         "decoder_layers, each (input_norm, input_eps, post_norm, post_eps, qkv, qkv_bias, o, o_bias, "
                         "gate_up, down, q_norm, k_norm, qk_eps, num_heads, num_kv_heads, head_dim, scale)")
      .def(py::init<std::vector<LayerWeights>>())
      .def("__len__", [](const LayerStack& stack) { return stack.layers.size(); });
  m.def("decoder_layers", &decoder_layers, "Llama-family decoder layers in turn, each norms, packed GEMMs, rotary, KV "
        "write and paged attention; returns the last one's (MLP output, residual stream) (CPU, float32, AVX-512 or "
        "AVX2)", py::arg("stack"), py::arg("x"), py::arg("residual"), py::arg("kv_caches"), py::arg("positions"),
        py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"), py::arg("num_decodes"),
        py::arg("decode_block_tables"), py::arg("decode_context_lens"), py::arg("prefills"), py::arg("keep"),
        release_gil());
  m.def("greedy_decode_window", &greedy_decode_window, "A window of greedy decode steps: each the embedding, "
        "decoder_layers, the final norm and the lm_head's first maximum (the screen's where given), its tokens the "
        "next step's, a row ending on one of its stop ids; returns [rows, steps] int64, -1 past a row's last step "
        "(CPU, float32, AVX-512 or AVX2)",
        py::arg("stack"), py::arg("kv_caches"), py::arg("cos"), py::arg("sin"), py::arg("embedding"),
        py::arg("final_norm"), py::arg("final_eps"), py::arg("head"), py::arg("head_bias"), py::arg("tokens"),
        py::arg("positions"), py::arg("block_tables"), py::arg("steps"), py::arg("block_size"),
        py::arg("stop_ids") = py::none(), py::arg("screen_packed") = py::none(),
        py::arg("screen_norms") = py::none(), py::arg("screen_order") = py::none(), py::arg("screen_int8_dims") = 0,
        py::arg("screen_rows") = py::none(),
        release_gil());
  m.def("paged_prefill_attention", &paged_prefill_attention, "Causal attention of one prefill chunk over its paged "
        "context, in place into out (CPU, float32, AVX-512 or AVX2)", py::arg("q"), py::arg("kv_cache"),
        py::arg("block_ids"), py::arg("start"), py::arg("scale"), py::arg("out"), release_gil());
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  m.def("pack_greedy_screen", &pack_greedy_screen, "The screen's copy of W's float32 row-block copy for "
        "greedy_screen_argmax (the first int8_dims of the dimensions in order in int8, the rest in bfloat16), and "
        "the norms of its rows' parts and of their rounding errors, into the previous copy's tensors where they fit "
        "(CPU, AVX512-BF16 and AVX512-VNNI)", py::arg("w_address"), py::arg("w_floats"), py::arg("out_features"),
        py::arg("in_features"), py::arg("block_stride"), py::arg("order"), py::arg("int8_dims"),
        py::arg("into_packed") = py::none(), py::arg("into_norms") = py::none(), release_gil());
  m.def("greedy_screen_argmax", &greedy_screen_argmax, "linear_row_blocks_argmax's answer from a screen of W in "
        "int8 and bfloat16 and float32 sums of the rows it cannot rule out (read from rows, W itself, where given); "
        "empty where it cannot answer (CPU, AVX512-BF16 and AVX512-VNNI)", py::arg("x"), py::arg("packed"),
        py::arg("norms"), py::arg("order"), py::arg("int8_dims"), py::arg("w_address"), py::arg("w_floats"),
        py::arg("out_features"), py::arg("block_stride"), py::arg("bias") = py::none(), py::arg("rows") = py::none(),
        release_gil());
#endif
}
