"""Specification of the one-call decoder layers (``kernels.decoder_layers``, builds with the row-block GEMM): the
layers run as one C++ call compute what their modules compute one by one, the same kernels in the same order, so
the logits and the KV cache they write are bitwise the ones of the module path, for every architecture's
differences (Qwen2's qkv bias, Qwen3's q/k norms), mixed steps of decodes and prefill chunks, and padded tokens.
Where it does not apply (a linear not packed, no attention kernel for the step) a layer takes the module path, and
the layers before and after it still run as one call each side.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from aioengine.messages import KVCacheConfig, ScheduledRequest, SchedulerOutput
from aioengine.model import one_call
from aioengine.testing import build_checkpoint
from aioengine.worker.cpu_worker import CPUWorker
from aioengine.worker.model_runner import ModelRunner
from aioengine.worker.step_inputs import prepare_inputs
from tests.conftest import engine_config

BLOCK = 16
SHAPES = [(0, 1), (20, 9), (15, 1), (0, 5), (40, 1), (16, 1)]
"""A mixed step as (start position, tokens): decodes at contexts 1, 16, 41 and 17 are sent ahead of a prefill
chunk continuing at position 20 and one from 0 (prepare_inputs puts decodes first)."""


@pytest.fixture(scope="module")
def layer_kernel(kernel: ModuleType) -> ModuleType:
    if not hasattr(kernel, "decoder_layers"):
        pytest.skip("the kernels were built without decoder_layers (AVX-512 and AVX2 builds have it)")
    return kernel


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelRunner]:
    arch = request.param
    ckpt = build_checkpoint(tmp_path_factory.mktemp(arch), arch, hidden_size=128, intermediate_size=192,
                            num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32)  # fmt: skip
    worker = CPUWorker(engine_config(ckpt, compile={"enforce_eager": True}))
    worker.init_device()
    worker.load_model()
    worker.initialize_from_config(KVCacheConfig(num_cache_blocks=48, block_size=BLOCK))
    assert worker.model_runner is not None
    yield worker.model_runner


def mixed_step(runner: ModelRunner, shapes: list[tuple[int, int]] = SHAPES) -> tuple[torch.Tensor, ...]:
    """Inputs of one step of ``shapes`` over distinct shuffled blocks (block 0, the null block, is never one)."""
    gen = torch.Generator().manual_seed(5)
    pool = (torch.randperm(47, generator=gen) + 1).tolist()
    reqs = [ScheduledRequest(f"r{i}", torch.randint(3, 500, (n,), generator=gen).tolist(), start,
                             [pool.pop() for _ in range(-(-(start + n) // BLOCK))], None)
            for i, (start, n) in enumerate(shapes)]  # fmt: skip
    inputs = prepare_inputs(
        SchedulerOutput(0, reqs),
        runner.block_size,
        runner.device,
        decode_kernel=runner.decode_kernel,
        prefill_kernel=runner.prefill_kernel,
    )
    return inputs.input_ids, inputs.positions, inputs.meta, torch.arange(len(inputs.input_ids))


def forward_both_ways(runner: ModelRunner, step: tuple) -> tuple[list[tuple[torch.Tensor, list]], list[int]]:
    """(logits, caches) of the step with the one-call layers and with the module path, from the same random
    caches; and how many layers ran in one-call runs each time."""
    assert runner.model is not None and runner.cache_engine is not None
    gen = torch.Generator().manual_seed(11)
    start = [torch.randn(c.shape, generator=gen) for c in runner.cache_engine.device_cache]
    taken: list[int] = []
    results = []
    run_layers = one_call.run_layers

    def counted(run: one_call.LayerRun, *args: object) -> object:
        taken[-1] += len(run.stack)
        return run_layers(run, *args)  # type: ignore[arg-type]

    try:
        one_call.run_layers = counted  # type: ignore[assignment]
        for flag in (True, False):
            one_call.LayerArgs.enabled = flag
            caches = [c.clone() for c in start]
            taken.append(0)
            with torch.inference_mode():
                logits = runner.model(step[0], step[1], caches, step[2], step[3])
            results.append((logits, caches))
    finally:
        one_call.run_layers = run_layers
        one_call.LayerArgs.enabled = True
    return results, taken


def test_one_call_layers_give_the_module_paths_logits_and_cache_bit_for_bit(
    layer_kernel: ModuleType, runner: ModelRunner
) -> None:
    results, taken = forward_both_ways(runner, mixed_step(runner))
    (fused, fused_caches), (plain, plain_caches) = results
    assert taken == [runner.model_info().num_layers, 0]
    assert torch.equal(fused, plain)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, plain_caches, strict=True))


@pytest.mark.parametrize(
    "shapes", [[(0, 30)], [(3, 1), (9, 1), (33, 1)], [(17, 14)]], ids=["prompt", "decodes", "chunk"]
)
def test_every_layer_runs_as_one_call_on_every_kind_of_step(
    layer_kernel: ModuleType, runner: ModelRunner, shapes: list[tuple[int, int]]
) -> None:
    results, taken = forward_both_ways(runner, mixed_step(runner, shapes))
    assert taken == [runner.model_info().num_layers, 0]
    assert torch.equal(results[0][0], results[1][0])


def test_padded_tokens_write_no_kv_and_leave_the_real_rows_as_they_are(
    layer_kernel: ModuleType, runner: ModelRunner
) -> None:
    ids, positions, meta, _ = mixed_step(runner, [(3, 1), (9, 1), (33, 1)])
    padded = torch.cat([ids, ids[:1]]), torch.cat([positions, positions[:1]])
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.tensor([-1])])
    meta.has_padding = True
    assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
    meta.decode_block_tables = torch.cat([meta.decode_block_tables, meta.decode_block_tables[:1]])
    meta.decode_context_lens = torch.cat([meta.decode_context_lens, meta.decode_context_lens[:1]])
    meta.num_decodes += 1
    results, taken = forward_both_ways(runner, (*padded, meta, torch.arange(4)))
    (fused, fused_caches), (plain, plain_caches) = results
    assert taken[0] == runner.model_info().num_layers
    assert torch.equal(fused, plain)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, plain_caches, strict=True))


def test_a_layer_whose_linear_is_not_packed_takes_the_module_path(
    layer_kernel: ModuleType, runner: ModelRunner
) -> None:
    assert runner.model is not None
    layer = runner.model.model.layers[1]
    linear = layer.mlp.down_proj
    row_blocks = linear._row_blocks
    linear._row_blocks = None  # a copy not in the row-block layout: oneDNN's GEMM reads it
    try:
        results, taken = forward_both_ways(runner, mixed_step(runner))
        runs = [(run.first, run.end, run.stack is not None) for run in runner.model._layer_runs.get()]
    finally:
        linear._row_blocks = row_blocks
    assert runs == [(0, 1, True), (1, 2, False), (2, 3, True)]
    assert taken == [runner.model_info().num_layers - 1, 0]
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)


def test_a_layers_kernel_arguments_are_made_once_and_again_when_a_weight_moves_or_changes(
    layer_kernel: ModuleType, runner: ModelRunner
) -> None:
    """A layer hands the kernel the arguments it made at its first one-call step until a packed copy is rebuilt
    elsewhere in memory or a norm's parameter is set anew (then it makes them again); a weight written in place
    shows through the same copy. Each time the one call computes the module path's logits bit for bit, from the
    weights as they are now."""
    assert runner.model is not None
    layer = runner.model.model.layers[1]
    linear = layer.mlp.down_proj
    step = mixed_step(runner)
    before, _ = forward_both_ways(runner, step)
    made, runs = layer.kernel_args.get(), runner.model._layer_runs.get()
    assert made is not None and layer.kernel_args.get() is made  # the step above made them: kept
    assert runner.model._layer_runs.get() is runs and [len(run.stack) for run in runs] == [3]  # and the stack of them

    held = linear._packed  # alive, so the next copy cannot land in its memory
    linear.drop_packed()  # the plain weight back, read from the copy; the next pack reorders into new memory
    moved, taken = forward_both_ways(runner, step)
    assert taken == [runner.model_info().num_layers, 0]
    remade = layer.kernel_args.get()
    assert remade is not None and remade is not made and linear.row_block_weight() in remade
    assert runner.model._layer_runs.get() is not runs  # a new stack holds the new copy
    assert torch.equal(moved[0][0], before[0][0])
    del held

    name = "model.layers.1.mlp.down_proj.weight"  # written as a weight update writes it: into the copy in place
    param, values = runner.model.get_parameter(name), linear.dense_weight().clone()
    for src in (values * 1.5, values):
        writer = runner.model.row_writer(name, param, src)
        assert writer is linear and writer.write_rows(0, param, src)
        runner.model.weight_written(name)
        changed, taken = forward_both_ways(runner, step)
        assert taken == [runner.model_info().num_layers, 0] and layer.kernel_args.get() is remade
        assert torch.equal(changed[0][0], changed[1][0])
        assert torch.equal(changed[0][0], before[0][0]) == (src is values)

    norm = layer.post_attention_layernorm
    kept = norm.weight
    try:
        norm.weight = torch.nn.Parameter(kept.detach() * 1.25, requires_grad=False)  # a new object: made again
        renormed, taken = forward_both_ways(runner, step)
        assert taken == [runner.model_info().num_layers, 0]
        assert torch.equal(renormed[0][0], renormed[1][0]) and not torch.equal(renormed[0][0], before[0][0])
    finally:
        norm.weight = kept


def test_a_step_without_the_attention_kernels_takes_the_module_path(
    layer_kernel: ModuleType, runner: ModelRunner
) -> None:
    ids, positions, meta, rows = mixed_step(runner)
    meta.prefill_kernel = None  # SDPA for the chunks: the whole layer stays in Python
    results, taken = forward_both_ways(runner, (ids, positions, meta, rows))
    assert taken == [0, 0]
    assert torch.equal(results[0][0], results[1][0])


def test_kernel_refuses_a_slot_outside_the_cache_naming_it(layer_kernel: ModuleType, runner: ModelRunner) -> None:
    ids, positions, meta, rows = mixed_step(runner, [(3, 1), (9, 1)])
    meta.slot_mapping = torch.tensor([5, 48 * BLOCK])
    assert runner.model is not None and runner.cache_engine is not None
    with pytest.raises(RuntimeError, match=f"slot {48 * BLOCK} of token 1 outside"), torch.inference_mode():
        runner.model(ids, positions, runner.cache_engine.device_cache, meta, rows)


def test_the_last_layer_runs_past_its_attention_only_the_rows_that_sample(
    layer_kernel: ModuleType, runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fewer rows sample than the step has tokens (decodes, and the last token of each prompt chunk): the last
    layer's o projection and MLP run those rows alone, one call or module by module, and their logits and every
    token's K and V are bitwise those of the step computed for all rows."""
    assert runner.model is not None
    ids, positions, meta, every = mixed_step(runner)
    rows = torch.tensor([0, 2, 3, 13, len(ids) - 1])
    seen: list[int] = []
    last_mlp = runner.model.model.layers[-1].mlp
    forward = type(last_mlp).forward
    monkeypatch.setattr(last_mlp, "forward", lambda x: (seen.append(x.shape[0]), forward(last_mlp, x))[1])
    whole, _ = forward_both_ways(runner, (ids, positions, meta, every))
    part, taken = forward_both_ways(runner, (ids, positions, meta, rows))
    assert taken == [runner.model_info().num_layers, 0]
    assert seen == [len(ids), len(rows)]  # the module path's last MLP: every row, then the sampling rows alone
    for (logits, caches), (some, some_caches) in zip(whole, part, strict=True):
        assert torch.equal(logits[rows], some)
        assert all(torch.equal(a, b) for a, b in zip(caches, some_caches, strict=True))
