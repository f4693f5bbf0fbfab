"""Loading an HF checkpoint directory: config, dtype, and safetensors weights tensor by tensor."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from aioengine.errors import CheckpointError
from aioengine.model.hf_config import CheckpointConfig
from aioengine.model.llama import LlamaForCausalLM, Shard, WeightTarget, build_model
from aioengine.model.parallel import SINGLE, TensorParallel

logger = logging.getLogger(__name__)

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]
"""(checkpoint name, shape, dtype): what is known of a tensor before its bytes are read."""

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str, hf_config: CheckpointConfig, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU (much faster there than bf16) and the checkpoint's dtype elsewhere."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(hf_config.dtype or "", torch.float32)


def resolve_max_model_len(hf_config: CheckpointConfig, requested: int | None) -> int:
    """The longest sequence (prompt + output) the engine will accept."""
    limit = hf_config.max_position_embeddings
    if requested is not None and requested > limit:
        raise CheckpointError(
            f"model.max_model_len={requested} exceeds the checkpoint's max_position_embeddings={limit}"
        )
    length = requested or limit
    window = hf_config.sliding_window
    if window and length > window:
        # Within the window full attention equals sliding attention, so capping keeps outputs exact.
        logger.warning("sliding-window attention is not implemented; max_model_len capped to %d", window)
        length = int(window)
    return length


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when sharded. Pickle files are refused."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {pickles}: pickle weights are never loaded, convert them to safetensors)" if pickles else ""
        raise CheckpointError(f"no *.safetensors files in {path}{hint}")
    return files


def _open_error(file: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(f"cannot read {file}: {exc} (truncated or not a safetensors file?)")


Selector = Callable[[str], WeightTarget | None]
"""Where a checkpoint tensor goes in this rank's model (``WeightPlan.targets.get``); None: not read at all."""


def shard_for_rank(tensor: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """This rank's part of a full checkpoint tensor (a view): THE place tensor parallelism slices weights."""
    return tensor if shard is None else tensor.narrow(shard.dim, shard.start, shard.size)


def narrowed(pairs: Iterable[tuple[str, torch.Tensor]], select: Selector) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors held in memory, as this rank's parts; names with no place are dropped."""
    for name, tensor in pairs:
        target = select(name)
        if target is not None:
            yield name, shard_for_rank(tensor, target.shard)


def iter_safetensors(files: Iterable[Path], select: Selector | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` one tensor at a time, so peak extra memory is one tensor.

    With ``select``, only the tensors it places are read, and of a sharded one only this rank's slice
    (``safe_open`` slices: the rest of the tensor is never read into memory).
    """
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # SafetensorError derives from Exception only
            raise _open_error(file, exc) from exc
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                target = select(name) if select is not None else WeightTarget(name)
                if target is not None:
                    yield name, _read(f, name, target.shard)


def _read(f: Any, name: str, shard: Shard | None) -> torch.Tensor:
    """Tensor ``name`` of an open safetensors file, or only its ``shard`` (the rest is never read)."""
    if shard is None:
        return f.get_tensor(name)
    view = f.get_slice(name)
    index = [slice(None)] * len(view.get_shape())
    index[shard.dim] = slice(shard.start, shard.start + shard.size)
    return view[tuple(index)]


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_specs(files: Iterable[Path]) -> list[TensorSpec]:
    """Name, shape and dtype of every tensor, read from the headers only (no tensor data is read).

    A truncated or corrupt file fails here: safetensors checks that the header covers the file.
    """
    specs: list[TensorSpec] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                    view = f.get_slice(name)
                    dtype = _ST_DTYPES.get(view.get_dtype())
                    if dtype is None:
                        raise CheckpointError(f"tensor {name!r} in {file} has unsupported dtype {view.get_dtype()}")
                    specs.append((name, tuple(view.get_shape()), dtype))
        except CheckpointError:
            raise
        except Exception as exc:
            raise _open_error(file, exc) from exc
    return specs


class WeightPlan:
    """Checks checkpoint tensors against a model and says where each goes, before anything is written.

    ``check`` validates one tensor (name, shape, dtype) and records the piece it fills; ``finish``
    checks that every parameter is covered (unless partial). Used over the whole source, from its
    headers, before the first write: when a model loads and when weights are swapped into a live one.
    """

    def __init__(self, model: LlamaForCausalLM, *, strict: bool = True, partial: bool = False) -> None:
        self.model = model
        self.strict = strict
        self.partial = partial
        self.params = dict(model.named_parameters())
        self.filled: dict[str, set[tuple[int, int]]] = {name: set() for name in self.params}  # (offset, rows)
        self.targets: dict[str, WeightTarget | None] = {}
        """Checked names -> where each goes (None: skipped)."""
        self._marked_changed = False
        self._rows_written: dict[str, int] = {}

    def check(self, name: str, shape: Iterable[int], dtype: torch.dtype) -> WeightTarget | None:
        """Where ``name`` goes (None: a tensor to skip); raises CheckpointError naming the tensor."""
        try:
            target = self.model.resolve_weight(name)
        except KeyError:
            if self.strict:
                raise CheckpointError(
                    f"checkpoint tensor {name!r} has no place in {type(self.model).__name__} "
                    "(set load.strict=false to skip unknown tensors)"
                ) from None
            target = None
        self.targets[name] = target
        if target is None:
            return None
        dst = self._piece(target)
        expected = list(dst.shape)
        if target.shard is not None:  # the checkpoint holds the whole tensor; this rank takes its shard
            expected[target.shard.dim] = target.shard.full
        if tuple(expected) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(shape)}, the model expects {tuple(expected)}")
        if not _castable(dtype, dst.dtype):
            raise CheckpointError(f"tensor {name!r} has dtype {dtype}, which cannot be cast safely to {dst.dtype}")
        self.filled[target.param].add((target.offset, _rows(dst)))
        return target

    def destination(self, target: WeightTarget) -> torch.Tensor:
        """The tensor to ``copy_`` the checked tensor into. Marks the model's derived weights stale (once:
        no forward runs between the writes of one plan, so nothing rebuilds them meanwhile)."""
        if not self._marked_changed:
            self.model.weights_changed()
            self._marked_changed = True
        return self._piece(target)

    def write(self, target: WeightTarget, tensor: torch.Tensor, *, check_finite: bool = False) -> bool:
        """Copies checked ``tensor`` into its piece (the packed copy too, in the same pass, where the model
        can: ``LlamaForCausalLM.row_writer``), then records it (``written``). With ``check_finite``, returns
        whether every value was finite, checked in the copying pass where the kernels copy (a streamed
        tensor is then read once, not twice), by one more read elsewhere; without, True."""
        piece = self.destination(target)
        writer = self.model.row_writer(target.param, piece, tensor)
        if writer is not None:
            finite = writer.write_rows(target.offset, piece, tensor)
        else:
            finite = copy_weight(piece, tensor, self.model.kernels, check_finite=check_finite)
        self.written(target)
        return finite or not check_finite

    def written(self, target: WeightTarget) -> None:
        """Records that ``target``'s piece was copied; once every row of its parameter has been, tells the
        model (``weight_written``: derived copies are rebuilt while the weight is in cache)."""
        done = self._rows_written.get(target.param, 0) + _rows(self._piece(target))
        self._rows_written[target.param] = done
        if done == _rows(self.params[target.param]):
            self.model.weight_written(target.param)

    def _piece(self, target: WeightTarget) -> torch.Tensor:
        # Checking only reads: stage_weights checks beside a running forward (Executor.run_aside), so
        # dropping the packed copies here would pull them from under that forward's layers.
        data = self.params[target.param].data
        return data if target.size is None else data.narrow(0, target.offset, target.size)

    def finish(self) -> None:
        """Raises CheckpointError unless every parameter is covered (skipped when partial)."""
        if self.partial:
            return
        # A set of pieces, not a running count: a tensor repeated in two shards cannot hide a missing one.
        missing = [n for n, pieces in self.filled.items() if sum(rows for _, rows in pieces) < _rows(self.params[n])]
        if missing:
            raise CheckpointError(f"checkpoint is missing tensors for: {', '.join(_hf_names(n) for n in missing[:8])}")


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite, at about the cost of one read: a NaN or Inf makes the sum
    non-finite, so a finite sum proves them all finite; only a sum that overflowed needs the exact
    (7x slower) element-wise check."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def copy_weight(dst: torch.Tensor, src: torch.Tensor, kernels: Any, *, check_finite: bool) -> bool:
    """``dst.copy_(src)``; with ``check_finite``, whether every value of ``src`` is finite (else True). The
    kernels copy two contiguous float32 CPU tensors of one shape past the caches and check each value as
    it goes; anything else is torch's copy, checked by one more read of ``src``."""
    if (
        kernels is not None
        and dst.dtype == src.dtype == torch.float32
        and dst.device.type == src.device.type == "cpu"
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.data_ptr() != src.data_ptr()
    ):
        return bool(kernels.copy_weight(dst, src)) or not check_finite
    dst.copy_(src)
    return not (check_finite and src.is_floating_point()) or all_finite(src)


def _rows(tensor: torch.Tensor) -> int:
    """Rows of a parameter or of its piece (a scalar counts as one): what a checkpoint tensor fills."""
    return tensor.shape[0] if tensor.dim() else 1


def _castable(src: torch.dtype, dst: torch.dtype) -> bool:
    """Float to float (any width) is a safe cast for weights; integers, bools and complex are not."""
    return src.is_floating_point == dst.is_floating_point and not src.is_complex


def _hf_names(param: str) -> str:
    """Our parameter name, with the checkpoint names it is fused from."""
    for fused, parts in (("qkv_proj", "q_proj/k_proj/v_proj"), ("gate_up_proj", "gate_proj/up_proj")):
        if f".{fused}." in param:
            return f"{param} (from {param.replace(fused, '{' + parts + '}')})"
    return param


def load_model(
    path: str | Path,
    hf_config: CheckpointConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    *,
    strict: bool = True,
    tp: TensorParallel = SINGLE,
) -> tuple[LlamaForCausalLM, int]:
    """Builds the model without initialising it (meta device), checks every tensor of the checkpoint against
    it (headers only), then fills it, reading only this rank's slice of each sharded tensor. Returns the model
    and the bytes of tensor data read."""
    with torch.device("meta"):
        model = build_model(hf_config, max_positions, tp)
    # What .to(dtype).to_empty(device) does, with torch.empty: empty_like of a meta tensor runs torch's
    # Python reference implementation, whose first use imports sympy (about 1 s of every start-up).
    model._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device))
    if model.tie_word_embeddings:  # materialising hands the tied pair separate storages
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.reset_buffers(device)
    files = checkpoint_files(path)
    plan = WeightPlan(model, strict=strict)
    for spec in safetensors_specs(files):
        plan.check(*spec)
    plan.finish()
    nbytes = 0
    for name, tensor in iter_safetensors(files, plan.targets.get):
        target = plan.targets[name]
        assert target is not None
        plan.destination(target).copy_(tensor)
        nbytes += tensor.nbytes
    return model.eval().requires_grad_(False), nbytes
