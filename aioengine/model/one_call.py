"""A run of decoder layers as one C++ call (``kernels.decoder_layers``): what each layer hands it, kept from step
to step (``LayerArgs``), the runs a model's layers make (``LayerRuns``), what a step hands every layer
(``layer_step``) and the call itself (``run_layers``); and a greedy decode window's steps, layers, final norm and
lm_head together, in one call (``run_greedy_window``). Each layer computes there what its modules compute, the
same kernels in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch

from aioengine.model.attention import AttentionMetadata
from aioengine.model.greedy_screen import GreedyHead
from aioengine.model.layers import RMSNorm, RotaryEmbedding


@dataclass(frozen=True, slots=True)
class LayerStep:
    """What every layer of a step hands ``kernels.decoder_layers`` besides its own weights and cache: made once a
    step (``layer_step``, from ``LlamaForCausalLM.final_hidden``) where the step's attention has kernels and the
    rotary is theirs."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (token start, tokens, start position, block ids)


@dataclass(frozen=True, slots=True)
class LayerRun:
    """Layers ``[first, end)`` of a model, run as one C++ call where ``stack`` (a ``kernels.LayerStack`` of their
    arguments) is set, else module by module."""

    first: int
    end: int
    kernels: Any = None
    stack: Any = None


class LayerArgs:
    """One decoder layer's arguments to ``kernels.decoder_layers`` (``get``), kept from step to step."""

    enabled: ClassVar[bool] = True
    """Whether layers run in ``kernels.decoder_layers`` where that applies (``run_layers``); off, always module by
    module (the reference it is tested against)."""

    def __init__(self, layer: Any) -> None:
        """``layer``: a Llama-family decoder layer (``LlamaDecoderLayer``: HF's module names), held through its
        modules alone."""
        # Plain references (this is no nn.Module: nothing registers) for get, which runs every step of every
        # layer: a submodule looked up through nn.Module costs about a microsecond.
        attn, mlp = layer.self_attn, layer.mlp
        self._attn = attn
        self._norms = (layer.input_layernorm, layer.post_attention_layernorm)
        self._parts = (mlp, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        # Where the kernel's other parameters live: a parameter set anew on its module replaces the entry here.
        owned = [
            (layer.input_layernorm, "weight"),
            (layer.post_attention_layernorm, "weight"),
            (attn.qkv_proj, "bias"),
            (attn.o_proj, "bias"),
            (attn.q_norm, "weight"),
            (attn.k_norm, "weight"),
        ]
        self._params = [(m._parameters, name) for m, name in owned if m is not None]
        self._cache: tuple[tuple[Any, ...], tuple[Any, ...] | None] | None = None

    @property
    def kernels(self) -> ModuleType | None:
        """The kernels the layer's MLP runs on (``use_cpu_kernels`` hands them over)."""
        kernels: ModuleType | None = self._parts[0].kernels
        return kernels

    def get(self) -> tuple[Any, ...] | None:
        """The layer's arguments to ``kernels.decoder_layers`` (its norms, packed copies, biases, head counts and
        the attention's scale: a ``LayerStack`` entry), or None where a linear's copy is not the row-block
        GEMM's, the kernels lack the call or heads are split across ranks. Made again whenever a packed copy
        moved or was rebuilt elsewhere (``row_block_weight`` brings each up to its weight first, as every step
        did before), the kernels changed or a norm's or bias's parameter was set anew (weight writes keep the
        objects and write their data, which the kernel then reads)."""
        mlp, qkv, o, gate_up, down = self._parts
        copies = (qkv.row_block_weight(), o.row_block_weight(), gate_up.row_block_weight(), down.row_block_weight())
        # The parameters by identity (tuples compare their items with ==, which a tensor answers elementwise);
        # the arguments hold the objects, so no other can take an id meanwhile.
        key = (mlp.kernels, copies, [id(params.get(name)) for params, name in self._params])
        cached = self._cache
        if cached is not None and cached[0] == key:
            return cached[1]
        attn = self._attn
        args: tuple[Any, ...] | None = None
        if hasattr(mlp.kernels, "decoder_layers") and attn.o_proj.tp.size == 1 and None not in copies:
            input_norm, post_norm = self._norms
            q_norm, k_norm = attn.q_norm, attn.k_norm
            args = (
                input_norm.weight,
                input_norm.eps,
                post_norm.weight,
                post_norm.eps,
                copies[0],
                attn.qkv_proj.bias,
                copies[1],
                attn.o_proj.bias,
                copies[2],
                copies[3],
                None if q_norm is None else q_norm.weight,
                None if k_norm is None else k_norm.weight,
                0.0 if q_norm is None else q_norm.eps,  # unused without the norms
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_dim,
                attn.scale,
            )
        self._cache = (key, args)
        return args


class LayerRuns:
    """A model's layers in order as runs (``get``): consecutive layers that each take the one call
    (``LayerArgs.get``) on the same kernels are one run with a ``kernels.LayerStack`` of their arguments, a layer
    that does not is a run of its own, module by module. Kept while every layer hands the same arguments, the same
    objects (a layer makes them again when a packed copy moved or a parameter was set anew): only then is a stack
    made again."""

    def __init__(self, layers: Sequence[LayerArgs]) -> None:
        self._layers = tuple(layers)  # plain references, read every step
        # The layers' arguments last seen, and the runs made of them.
        self._made: tuple[list[tuple[Any, ...] | None], list[LayerRun]] | None = None

    def get(self) -> list[LayerRun]:
        layers = self._layers
        args = [layer.get() if layer.enabled else None for layer in layers]
        if self._made is not None and all(a is b for a, b in zip(self._made[0], args, strict=True)):
            return self._made[1]
        runs: list[LayerRun] = []
        first = 0
        while first < len(args):
            end = first + 1
            if args[first] is None:
                runs.append(LayerRun(first, end))
            else:
                kernels: Any = layers[first].kernels  # it has decoder_layers: args[first] is set
                while end < len(args) and args[end] is not None and layers[end].kernels is kernels:
                    end += 1
                runs.append(LayerRun(first, end, kernels, kernels.LayerStack(args[first:end])))
            first = end
        self._made = (args, runs)
        return runs


def layer_step(
    positions: torch.Tensor, meta: AttentionMetadata, rotary: RotaryEmbedding, head_dim: int
) -> LayerStep | None:
    """The step's ``LayerStep`` where its attention runs in the C++ kernels (a decode kernel for decode rows,
    a prefill kernel for prompt chunks: none for a head size off 16) and so does the rotary (``rotary``, over
    the whole head of ``head_dim``); else None, and every layer runs module by module."""
    if (
        (meta.num_decodes and meta.decode_kernel is None)
        or (meta.prefills and meta.prefill_kernel is None)
        or not rotary.kernel_covers(head_dim)
    ):
        return None
    return LayerStep(
        positions,
        rotary.cos_cached,
        rotary.sin_cached,
        meta.slot_mapping,
        meta.num_decodes,
        meta.decode_block_tables,
        meta.decode_context_lens,
        [(c.token_start, c.num_tokens, c.start_pos, c.block_ids) for c in meta.prefills],
    )


def run_layers(
    run: LayerRun,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    kv_caches: list[torch.Tensor],
    step: LayerStep,
    keep: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A run of layers (over ``kv_caches``, theirs) as one C++ call: each layer what its modules compute,
    the same kernels in the same order (``LlamaDecoderLayer.forward`` says what ``x``, ``residual`` and
    ``keep`` are). A decode step otherwise pays Python and torch's dispatch some 40 times a layer, and
    ~65 us between two layers' calls of one each."""
    out: tuple[torch.Tensor, torch.Tensor] = run.kernels.decoder_layers(
        run.stack,
        x.contiguous(),
        residual,
        kv_caches,
        step.positions,
        step.cos,
        step.sin,
        step.slot_mapping,
        step.num_decodes,
        step.decode_block_tables,
        step.decode_context_lens,
        step.prefills,
        keep,
    )
    return out


@dataclass(frozen=True, slots=True, eq=False)
class GreedyWindow:
    """A decode window's rows as ``kernels.greedy_decode_window`` takes them (``LlamaForCausalLM.greedy_window``)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    block_tables: torch.Tensor
    steps: torch.Tensor
    block_size: int
    stop_ids: torch.Tensor | None = None
    """[rows, S] int64, -1 padded: a row that picks one of its own ends there."""


def run_greedy_window(
    runs: list[LayerRun],
    window: GreedyWindow,
    embedding: torch.Tensor,
    rotary: RotaryEmbedding,
    norm: RMSNorm,
    head: GreedyHead,
    kv_caches: list[torch.Tensor],
) -> torch.Tensor | None:
    """``window`` in one call: each step the ``embedding``, the layers, the final ``norm`` and ``head``'s first
    maximum, as the model runs a step. None where that call does not apply: the layers not one run on the kernels
    (``runs``), or a final norm that runs torch's ops."""
    kernels: Any = runs[0].kernels
    if len(runs) != 1 or runs[0].stack is None or not hasattr(kernels, "greedy_decode_window"):
        return None
    if norm.kernels is not runs[0].kernels or norm.weight.dtype != torch.float32:
        return None  # its add_and_norm runs torch's ops
    tokens: torch.Tensor = kernels.greedy_decode_window(
        runs[0].stack,
        kv_caches,
        rotary.cos_cached,
        rotary.sin_cached,
        embedding,
        norm.weight,
        norm.eps,
        head.copy,
        head.bias,
        window.tokens,
        window.positions,
        window.block_tables,
        window.steps,
        window.block_size,
        window.stop_ids,
        **head.screen_args(),
    )
    return tokens
