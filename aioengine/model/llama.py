"""Native Llama-family model (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Module names mirror HF's so checkpoint names map one to one, except the fused projections:
``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj`` and ``gate_proj``/``up_proj`` -> ``gate_up_proj``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, cast

import torch
from torch import nn

from aioengine.model import one_call
from aioengine.model.attention import AttentionMetadata, paged_attention
from aioengine.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, VocabEmbedding
from aioengine.model.linear import Linear, RowParallelLinear
from aioengine.model.packing import mark_packed_weights_stale
from aioengine.model.parallel import SINGLE, TensorParallel
from aioengine.model.tp_layout import split_heads


@dataclass(frozen=True, slots=True)
class Shard:
    """The part of a checkpoint tensor one tensor-parallel rank holds: ``[start, start + size)`` along ``dim``
    of a tensor that has ``full`` there."""

    dim: int
    start: int
    size: int
    full: int


@dataclass(frozen=True, slots=True)
class WeightTarget:
    """Where one checkpoint tensor goes: rows ``[offset, offset + size)`` of parameter ``param``; under tensor
    parallelism only the checkpoint tensor's ``shard`` (None: all of it, a replicated tensor)."""

    param: str
    offset: int = 0
    size: int | None = None  # None: the whole parameter
    shard: Shard | None = None


def head_dim_of(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads_of(hf_config: Any) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def tp_heads(cfg: Any, tp: TensorParallel) -> tuple[int, int, int]:
    """This rank's query heads, KV heads, and the first KV head it holds (``tp_layout.split_heads``)."""
    return split_heads(cfg.num_attention_heads, num_kv_heads_of(cfg), tp.size, tp.rank)


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: Any, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.first_kv_head = tp_heads(cfg, tp)  # this rank's
        self.head_dim = head_dim_of(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, o_bias, tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = rotary

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every token's K and V into the cache; the output for every row, or for the rows of ``keep`` only."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale).reshape(t, self.q_size)
        return self.o_proj(out if keep is None else out[keep])


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: Any, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, qkv_bias, o_bias, qk_norm, tp)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Its arguments to kernels.decoder_layers, kept from step to step.
        self.kernel_args = one_call.LayerArgs(self)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous layer's MLP output, not yet added into ``residual`` (the residual stream,
        updated in place); for the first layer the embeddings, with ``residual`` None. Each add is fused
        into the norm that follows it. Where the C++ kernels cover the whole layer the model runs it there
        instead (``one_call.run_layers``), computing what the modules below do.

        With ``keep`` (row indices: the last layer, given the rows that sample) every token still writes its
        K and V, but everything after the attention runs for those rows alone, and both results are theirs
        (the residual stream then a new tensor). Each row's sums are the same either way."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, positions, kv_cache, meta, keep)
        if keep is not None:
            residual = residual[keep]
        h = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: Any, max_positions: int, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(cfg, head_dim_of(cfg), max_positions)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, self.rotary_emb, qkv_bias, o_bias, qk_norm, tp) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole family; ``qkv_bias`` (Qwen2) and ``qk_norm`` (Qwen3) switch the differences.

    Under tensor parallelism (``tp.size > 1``) this is one rank's shard: attention by heads, the MLP by
    intermediate rows, embedding and LM head by vocabulary rows; every rank returns the full logits.
    """

    kernels: ModuleType | None = None
    """The C++ CPU kernels, where the model runs with them: a weight write copies plain weights with them
    (``copy_weight``: past the caches, each value checked as it goes)."""

    def __init__(
        self,
        cfg: Any,
        max_positions: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, max_positions, qkv_bias, o_bias, qk_norm, tp)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = Linear(cfg.hidden_size, self.model.embed_tokens.rows, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The layers as runs of one C++ call each where they take it, kept from step to step.
        layers = cast(list[LlamaDecoderLayer], self.model.layers)
        self._layer_runs = one_call.LayerRuns([layer.kernel_args for layer in layers])

    def weights_changed(self) -> None:
        """Call after writing parameters in place by any means other than ``WeightPlan`` (which calls it):
        copies derived from the weights (oneDNN-packed linear weights) are rebuilt on the next forward.
        Writes through ``param.data`` do not bump the version counter, so they cannot be seen otherwise."""
        mark_packed_weights_stale(self)

    def row_writer(self, param: str, piece: torch.Tensor, src: torch.Tensor) -> Linear | None:
        """The one linear layer computing from parameter ``param`` if it writes ``src`` into ``piece`` (its rows
        of that parameter) and into its packed copy in one pass (``Linear.write_rows``); else None, and the
        caller copies (``weight_written`` then repacks)."""
        linears = self._linears_of.get(param, ())
        return linears[0] if len(linears) == 1 and linears[0].takes_rows(piece, src) else None

    def weight_written(self, param: str) -> None:
        """Called by a weight write once parameter ``param`` is wholly written: the linear layers computing
        from it rebuild their packed copies now, while the weight is still in the CPU's caches, instead of
        reading it all back from memory after the write."""
        for linear in self._linears_of.get(param, ()):
            if linear.prepack_hint is not None:
                linear.pack()

    @functools.cached_property
    def _linears_of(self) -> dict[str, list[Linear]]:
        # By identity: the tied LM head's weight is the embedding's parameter, named once.
        names = {id(p): n for n, p in self.named_parameters()}
        out: dict[str, list[Linear]] = {}
        for module in self.modules():
            if isinstance(module, Linear):
                out.setdefault(names[id(module.weight)], []).append(module)
        return out

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """Runs every token of the step; returns logits only for ``logits_indices`` ([S, V], float32; None: every
        token's)."""
        return self.compute_logits(self.final_hidden(input_ids, positions, kv_caches, meta, logits_indices))

    def final_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """``forward`` up to the lm_head: the final norm's output for the rows of ``logits_indices`` ([S, H]; None:
        every token's, as a decode batch has them, without gathering the rows of the identity).

        Where fewer rows sample than the step has tokens (a prompt samples at its last token, a chunk that does
        not end its prompt not at all), the last layer computes past its attention only the rows that sample:
        the other tokens need nothing from it but their K and V. A model of 8 layers saves an eighth of a
        prompt's GEMMs. The rows it keeps are summed as they would be among all the others."""
        layers = self.model.layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} layers")
        keep = logits_indices if logits_indices is not None and logits_indices.shape[0] < input_ids.shape[0] else None
        x, residual = self.model.embed_tokens(input_ids), None
        step = one_call.layer_step(positions, meta, self.model.rotary_emb, head_dim_of(self.config))
        on_kernels = step is not None and x.dtype == torch.float32 and x.device.type == "cpu"
        for run in self._layer_runs.get() if on_kernels else [one_call.LayerRun(0, len(layers))]:
            run_keep = keep if run.end == len(layers) else None
            if run.stack is not None:
                assert step is not None
                x, residual = one_call.run_layers(run, x, residual, kv_caches[run.first : run.end], step, run_keep)
                continue
            for i in range(run.first, run.end):
                last_keep = run_keep if i == run.end - 1 else None
                x, residual = layers[i](x, residual, positions, kv_caches[i], meta, last_keep)
        assert residual is not None
        if keep is None and logits_indices is not None:  # the last add and the norm are per token: the sampled rows
            x, residual = x[logits_indices], residual[logits_indices]
        return self.model.norm.add_and_norm(x, residual)

    def greedy_window(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        steps: torch.Tensor,
        kv_caches: list[torch.Tensor],
        block_size: int,
        stop_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """A decode window of greedy steps in one call (``kernels.greedy_decode_window``): row b computes
        ``tokens[b]`` at ``positions[b]``, then for ``steps[b]`` - 1 more steps the token the step before picked (as
        ``greedy_tokens`` picks); ``block_tables`` cover them; a row ends on one of its ``stop_ids`` ([rows, S], -1
        padded). Returns [rows, most steps] int64, -1 past a row's last step; None where the model cannot (layers
        not in one kernel run, the head off the row-block kernels, tensor parallelism)."""
        rotary, embedding = self.model.rotary_emb, self.model.embed_tokens.weight
        if (
            self.tp.size != 1
            or len(kv_caches) != len(self.model.layers)
            or not rotary.kernel_covers(head_dim_of(self.config))
        ):
            return None
        if embedding.dtype != torch.float32 or embedding.device.type != "cpu" or not embedding.is_contiguous():
            return None
        head = self.lm_head.greedy_head()
        if head is None:
            return None
        window = one_call.GreedyWindow(tokens, positions, block_tables, steps, block_size, stop_ids)
        runs = self._layer_runs.get()
        return one_call.run_greedy_window(runs, window, embedding, rotary, self.model.norm, head, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head over ``final_hidden``'s rows: [S, V] float32 (gathered from every rank)."""
        return self.tp.all_gather(self.lm_head(hidden).float())

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The first maximum of each row of ``compute_logits(hidden)`` ([S] int64) without computing those logits
        (``Linear.first_max``), where one rank holds the whole lm_head; else None."""
        return self.lm_head.first_max(hidden) if self.tp.size == 1 else None

    # ---- weight names -------------------------------------------------------------------------------
    _FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def resolve_weight(self, hf_name: str) -> WeightTarget | None:
        """Maps a checkpoint tensor name to its place in this model; None for names to skip.

        Raises KeyError for a name the model does not have.
        """
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None  # old checkpoints store it; we compute it
        if hf_name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        parts = hf_name.rsplit(".", 2)
        layer = cast(LlamaDecoderLayer, self.model.layers[0])
        if len(parts) == 3 and parts[1] in self._FUSED:
            fused, shard = self._FUSED[parts[1]]
            attn = layer.self_attn
            sizes = (
                (attn.q_size, attn.kv_size, attn.kv_size) if fused == "qkv_proj" else (layer.mlp.intermediate_size,) * 2
            )
            target = WeightTarget(f"{parts[0]}.{fused}.{parts[2]}", sum(sizes[:shard]), sizes[shard])
        else:
            target = WeightTarget(hf_name)
        if self.tp.size > 1 and len(parts) >= 2:
            target = dataclasses.replace(target, shard=self._shard(parts[-2], parts[-1], layer))
        if target.param not in self._param_names:
            raise KeyError(hf_name)
        return target

    def _shard(self, module: str, kind: str, layer: LlamaDecoderLayer) -> Shard | None:
        """This rank's part of a checkpoint tensor of ``module`` (its last name), by the layout in the class
        docstring; None for a replicated tensor (norms, and the bias of a row-parallel layer)."""
        attn, rank = layer.self_attn, self.tp.rank
        q, kv, hd = attn.q_size, attn.kv_size, attn.head_dim
        mlp = layer.mlp.intermediate_size
        rows = self.model.embed_tokens.rows
        layouts = {
            "q_proj": (0, rank * q, q, q * self.tp.size),
            "k_proj": (0, attn.first_kv_head * hd, kv, num_kv_heads_of(self.config) * hd),
            "o_proj": (1, rank * q, q, q * self.tp.size),
            "gate_proj": (0, rank * mlp, mlp, mlp * self.tp.size),
            "down_proj": (1, rank * mlp, mlp, mlp * self.tp.size),
            "embed_tokens": (0, rank * rows, rows, rows * self.tp.size),
        }
        layouts["v_proj"], layouts["up_proj"], layouts["lm_head"] = (
            layouts["k_proj"],
            layouts["gate_proj"],
            layouts["embed_tokens"],
        )
        layout = layouts.get(module)
        if layout is None or (layout[0] == 1 and kind != "weight"):
            return None
        return Shard(*layout)

    @functools.cached_property
    def _param_names(self) -> frozenset[str]:
        # Names never change after __init__ (to_empty / sleep swap tensors, not parameters' names).
        return frozenset(n for n, _ in self.named_parameters(remove_duplicate=False))


def build_model(cfg: Any, max_positions: int, tp: TensorParallel = SINGLE) -> LlamaForCausalLM:
    """Instantiates the model class for ``cfg.architectures[0]`` (parameters uninitialised): this rank's
    shard of it under tensor parallelism."""
    arch = cfg.architectures[0]
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    qwen2 = arch == "Qwen2ForCausalLM"  # q/k/v carry a bias, o_proj never does
    return LlamaForCausalLM(
        cfg,
        max_positions,
        qkv_bias=qwen2 or attention_bias,
        o_bias=attention_bias and not qwen2,
        qk_norm=arch == "Qwen3ForCausalLM",
        tp=tp,
    )
