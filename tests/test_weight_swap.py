"""Specification of hot weight swap through the public API: AsyncEngine.update_weights,
reload_weights, weights_version and RequestOutput.weights_version.

Two random-init checkpoints of the same shape: A (the engine's, seed 0) and B (seed 1). Expected
tokens come from HF transformers ``generate`` on the same checkpoints (float32, one prompt at a
time), never from the engine. Expected weights come from per-parameter sha256 checksums read on
the worker thread (``collective_rpc`` with a callable), so "nothing changed" means bit for bit.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from aioengine import AsyncEngine, RequestOutput, SamplingParams
from aioengine.errors import CheckpointError, InvalidRequestError
from aioengine.testing import build_checkpoint, build_tokenizer
from tests.helpers import hf_generate

TIMEOUT = 60.0
"""Seconds any single await on the engine may take: a hung stream fails its test, not the run."""
NEW_TOKENS = 24
NUM_STREAMS = 30
NUM_LATE = 5
"""Requests sent while a swap is in progress (prompts 0..4 again, under new request ids)."""
FEW = 6
"""Prompts checked after a swap outside the concurrency tests."""
MODES = ["pause", "drain", "abort", "recompute"]


def random_prompts(num: int, seed: int, max_len: int = 24) -> list[list[int]]:
    """``num`` prompts of 1..max_len random ids, none of them a special token."""
    vocab = len(build_tokenizer())
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = random_prompts(NUM_STREAMS, seed=4321)


# ---- references ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def hf_model(path: Path, round_trip: torch.dtype | None = None) -> Any:
    """HF's float32 model of ``path``; with ``round_trip`` its parameters are rounded to that dtype first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if round_trip is not None:  # parameters only: model.to() would also round the rotary buffers
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(round_trip))
    return model


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int | list[int] = NEW_TOKENS,
              round_trip: torch.dtype | None = None) -> list[list[int]]:  # fmt: skip
    """HF's greedy continuation of each prompt, one prompt at a time, EOS ignored."""
    return hf_generate(hf_model(path, round_trip), prompts, new_tokens)


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama-b", "llama", seed=1)


@pytest.fixture(scope="module")
def ref(llama_ckpt: Path, ckpt_b: Path) -> dict[str, list[list[int]]]:
    """HF greedy tokens of every prompt under checkpoint "A" (the engine's) and "B"."""
    return {"A": hf_greedy(llama_ckpt, PROMPTS), "B": hf_greedy(ckpt_b, PROMPTS)}


@pytest.fixture
async def engine(llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]) -> Any:
    async with make_engine(llama_ckpt) as engine:
        yield engine


# ---- helpers ---------------------------------------------------------------------------------------
def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def final(engine: AsyncEngine, prompt: list[int], params: SamplingParams | None = None) -> RequestOutput:
    out = None
    async with asyncio.timeout(TIMEOUT):
        async for out in engine.generate(prompt, params or greedy()):
            pass
    assert out is not None and out.finished
    return out


async def token_ids(engine: AsyncEngine, prompts: list[list[int]] = PROMPTS[:FEW]) -> list[list[int]]:
    outs = await asyncio.gather(*(final(engine, p) for p in prompts))
    return [list(o.token_ids) for o in outs]


def _param_checksums(worker: Any) -> dict[str, str]:
    return {
        name: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, p in worker.model_runner.model.named_parameters()
    }


async def checksums(engine: AsyncEngine) -> dict[str, str]:
    """sha256 of every parameter's bytes, computed on the worker thread between steps."""
    return (await engine.collective_rpc(_param_checksums))[0]


def b_tensors(ckpt: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    tensors = load_file(str(ckpt / "model.safetensors"))
    return tensors if dtype is None else {n: t.to(dtype) for n, t in tensors.items()}


# ---- a good swap: outputs follow the new weights, from every kind of source --------------------------
def test_checkpoints_a_and_b_give_different_greedy_outputs_for_every_prompt(ref: dict[str, list[list[int]]]) -> None:
    # The swap tests below only prove something if A and B disagree on every prompt.
    assert all(len(t) == NEW_TOKENS for t in ref["A"] + ref["B"])
    assert all(a != b for a, b in zip(ref["A"], ref["B"], strict=True))


SOURCES: dict[str, Callable[[Path], tuple[Any, bool]]] = {
    "directory": lambda ckpt: (ckpt, False),
    "file": lambda ckpt: (ckpt / "model.safetensors", False),
    "dict": lambda ckpt: (b_tensors(ckpt), False),
    "iterator": lambda ckpt: ((pair for pair in b_tensors(ckpt).items()), False),
    "staged": lambda ckpt: (ckpt, True),
}


@pytest.mark.parametrize("kind", list(SOURCES))
async def test_swap_to_b_gives_hf_outputs_of_b_and_swap_back_gives_those_of_a(
    engine: AsyncEngine, kind: str, llama_ckpt: Path, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    assert await token_ids(engine) == ref["A"][:FEW]
    source, stage = SOURCES[kind](ckpt_b)
    await engine.update_weights(source, stage=stage)
    assert await token_ids(engine) == ref["B"][:FEW]
    source, stage = SOURCES[kind](llama_ckpt)
    await engine.update_weights(source, stage=stage)
    assert await token_ids(engine) == ref["A"][:FEW]


async def test_a_staged_file_is_read_at_staging_so_rewriting_the_file_before_the_swap_changes_nothing(
    engine: AsyncEngine, llama_ckpt: Path, ckpt_b: Path, tmp_path: Path, ref: dict[str, list[list[int]]]
) -> None:
    # A trainer writes its next checkpoint over the file the engine staged. What was staged (and
    # checked) must be what is swapped in: staging reads the bytes, it does not keep a view of the file.
    file = tmp_path / "next.safetensors"
    file.write_bytes((ckpt_b / "model.safetensors").read_bytes())
    in_flight = asyncio.create_task(final(engine, PROMPTS[0], greedy(100)))  # keeps the drain going a while
    await asyncio.sleep(0)
    update = asyncio.create_task(engine.update_weights(file, mode="drain", stage=True))
    async with asyncio.timeout(TIMEOUT):
        while not (update.done() or engine.core is not None and engine.core.hold_admission):
            await asyncio.sleep(0.001)  # staged; now draining (an internal flag: no public signal exists)
    assert not update.done(), "the drain was over before the file could be rewritten"
    with open(file, "r+b") as f:  # in place, as a trainer saving to the same path does
        f.write((llama_ckpt / "model.safetensors").read_bytes())
    await update
    await in_flight
    assert await token_ids(engine) == ref["B"][:FEW]


async def test_outputs_after_a_swap_carry_the_new_weights_version(engine: AsyncEngine, ckpt_b: Path) -> None:
    before = await final(engine, PROMPTS[0])
    await engine.update_weights(ckpt_b)
    after = await final(engine, PROMPTS[0])
    assert (before.weights_version, after.weights_version) == (0, 1)


async def test_reload_weights_restores_the_configured_checkpoint(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    await engine.update_weights(ckpt_b)
    await engine.reload_weights()
    assert await token_ids(engine) == ref["A"][:FEW]


async def test_a_float64_source_is_cast_and_gives_hf_outputs_of_b(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    # float32 -> float64 -> float32 is exact, so the engine must hold B bit for bit.
    await engine.update_weights(b_tensors(ckpt_b, torch.float64))
    assert await token_ids(engine) == ref["B"][:FEW]


async def test_a_bfloat16_source_is_cast_and_gives_hf_outputs_of_b_rounded_to_bfloat16(
    engine: AsyncEngine, ckpt_b: Path
) -> None:
    await engine.update_weights(b_tensors(ckpt_b, torch.bfloat16))
    dtypes = await engine.collective_rpc(lambda w: {p.dtype for p in w.model_runner.model.parameters()})
    assert dtypes == [{torch.float32}]
    assert await token_ids(engine) == hf_greedy(ckpt_b, PROMPTS[:FEW], round_trip=torch.bfloat16)


# ---- a bad source changes nothing -------------------------------------------------------------------
def _truncated(ckpt: Path, tmp: Path) -> Path:
    data = (ckpt / "model.safetensors").read_bytes()
    (tmp / "cut.safetensors").write_bytes(data[:-100])
    return tmp / "cut.safetensors"


def _garbage(ckpt: Path, tmp: Path) -> Path:
    (tmp / "garbage.safetensors").write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    return tmp / "garbage.safetensors"


def _replace(ckpt: Path, name: str, tensor: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors = b_tensors(ckpt)
    tensors[name] = tensor(tensors[name])
    return tensors


def _without(ckpt: Path, name: str) -> dict[str, torch.Tensor]:
    tensors = b_tensors(ckpt)
    del tensors[name]
    return tensors


def _duplicated(ckpt: Path) -> Iterator[tuple[str, torch.Tensor]]:
    tensors = b_tensors(ckpt)
    yield from tensors.items()
    yield "model.layers.0.mlp.down_proj.weight", tensors["model.layers.0.mlp.down_proj.weight"]


# Each bad tensor comes LAST in its source, so a loader that writes before it has checked everything
# would already have changed the model when it fails. Values: (source, stage, regex of the message).
BAD_SOURCES: dict[str, Callable[[Path, Path], tuple[Any, bool, str]]] = {
    "missing tensor": lambda b, tmp: (_without(b, "model.norm.weight"), False, r"missing.*model\.norm\.weight"),
    "missing part of a fused tensor": lambda b, tmp: (
        _without(b, "model.layers.1.self_attn.k_proj.weight"), False, r"missing.*model\.layers\.1\.self_attn.*k_proj"
    ),
    "unknown name": lambda b, tmp: (
        {**b_tensors(b), "model.layers.1.mlp.extra_proj.weight": torch.zeros(4)}, False,
        r"model\.layers\.1\.mlp\.extra_proj\.weight.*no place",
    ),
    "wrong shape": lambda b, tmp: (
        _replace(b, "model.norm.weight", lambda t: torch.cat([t, t])), False, r"model\.norm\.weight.*shape \(128,\)"
    ),
    "int64 dtype": lambda b, tmp: (
        _replace(b, "model.norm.weight", lambda t: t.to(torch.int64)), False, r"model\.norm\.weight.*int64.*cannot"
    ),
    "truncated file": lambda b, tmp: (_truncated(b, tmp), False, r"cut\.safetensors"),
    "corrupt file": lambda b, tmp: (_garbage(b, tmp), False, r"garbage\.safetensors"),
    "duplicated name": lambda b, tmp: (_duplicated(b), False, r"model\.layers\.0\.mlp\.down_proj\.weight.*twice"),
    "missing path": lambda b, tmp: (tmp / "nowhere", False, r"nowhere.*does not exist"),
    "wrong shape, staged": lambda b, tmp: (
        _replace(b, "model.norm.weight", lambda t: t[:-1]), True, r"model\.norm\.weight.*shape \(63,\)"
    ),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
async def test_a_bad_source_is_refused_naming_the_problem_and_changes_nothing(
    engine: AsyncEngine, case: str, ckpt_b: Path, tmp_path: Path, ref: dict[str, list[list[int]]]
) -> None:
    source, stage, message = BAD_SOURCES[case](ckpt_b, tmp_path)
    before = await checksums(engine)
    with pytest.raises(CheckpointError, match=message):
        await engine.update_weights(source, stage=stage)
    assert await checksums(engine) == before
    assert engine.weights_version == 0
    assert await token_ids(engine) == ref["A"][:FEW]


async def test_an_unknown_mode_is_refused_with_value_error_and_changes_nothing(
    engine: AsyncEngine, ckpt_b: Path
) -> None:
    before = await checksums(engine)
    with pytest.raises(ValueError, match="'swap'"):
        await engine.update_weights(ckpt_b, mode="swap")
    assert await checksums(engine) == before
    assert engine.weights_version == 0


# ---- partial updates, in place -----------------------------------------------------------------------
async def test_a_partial_update_of_one_layer_changes_exactly_that_layers_parameters_to_b(
    engine: AsyncEngine, ckpt_b: Path, make_engine: Callable[..., AsyncEngine]
) -> None:
    async with make_engine(ckpt_b) as engine_b:
        b = await checksums(engine_b)
    layer_1 = {n: t for n, t in b_tensors(ckpt_b).items() if n.startswith("model.layers.1.")}
    before = await checksums(engine)
    await engine.update_weights(layer_1, partial=True)
    after = await checksums(engine)
    in_layer_1 = {n for n in before if n.startswith("model.layers.1.")}
    assert any(b[n] != before[n] for n in in_layer_1)  # (the norms start as ones in both checkpoints)
    assert after == {n: b[n] if n in in_layer_1 else before[n] for n in before}


async def test_one_layer_without_partial_is_refused_as_missing_tensors(engine: AsyncEngine, ckpt_b: Path) -> None:
    layer_1 = {n: t for n, t in b_tensors(ckpt_b).items() if n.startswith("model.layers.1.")}
    before = await checksums(engine)
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.0\."):
        await engine.update_weights(layer_1, partial=False)
    assert await checksums(engine) == before


@pytest.mark.parametrize("stage", [False, True], ids=["streamed", "staged"])
async def test_an_update_writes_in_place_keeping_every_parameter_address(
    engine: AsyncEngine, ckpt_b: Path, stage: bool
) -> None:
    def addresses(worker: Any) -> dict[str, int]:
        return {n: p.data_ptr() for n, p in worker.model_runner.model.named_parameters()}

    before = await engine.collective_rpc(addresses)
    checks = await checksums(engine)
    await engine.update_weights(ckpt_b, stage=stage)
    assert await checksums(engine) != checks  # the weights did change...
    assert await engine.collective_rpc(addresses) == before  # ...where they were


# ---- the report and the version counter -----------------------------------------------------------------
async def test_the_report_gives_tensors_bytes_and_seconds_of_the_source(engine: AsyncEngine, ckpt_b: Path) -> None:
    tensors = b_tensors(ckpt_b)
    report = await engine.update_weights(ckpt_b)
    assert report["tensors"] == len(tensors)
    assert report["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert report["seconds"] >= report["pause_seconds"] >= 0.0


async def test_weights_version_counts_successful_updates_only(engine: AsyncEngine, ckpt_b: Path) -> None:
    versions = [engine.weights_version]
    await engine.update_weights(ckpt_b)
    versions.append(engine.weights_version)
    with pytest.raises(CheckpointError):
        await engine.update_weights(_without(ckpt_b, "model.norm.weight"))
    versions.append(engine.weights_version)
    report = await engine.update_weights(ckpt_b, mode="drain")
    versions.append(engine.weights_version)
    assert versions == [0, 1, 1, 2]
    assert report["weights_version"] == 2
    assert (await final(engine, PROMPTS[0])).weights_version == 2


# ---- together with sleep ----------------------------------------------------------------------------
async def test_level_2_sleep_then_wake_weights_update_to_b_and_wake_kv_cache_gives_outputs_of_b(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    await engine.sleep(level=2)
    await engine.wake_up(["weights"])
    await engine.update_weights(ckpt_b)
    await engine.wake_up(["kv_cache"])
    assert await token_ids(engine) == ref["B"][:FEW]


async def test_level_1_sleep_then_wake_then_update_to_b_gives_outputs_of_b(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    await engine.sleep(level=1)
    await engine.wake_up()
    await engine.update_weights(ckpt_b)
    assert await token_ids(engine) == ref["B"][:FEW]


async def test_updating_weights_that_are_asleep_is_refused_with_invalid_request_error(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    await engine.sleep(level=1)
    with pytest.raises(InvalidRequestError, match="wake_up"):
        await engine.update_weights(ckpt_b)
    await engine.wake_up()
    assert engine.weights_version == 0
    assert await token_ids(engine) == ref["A"][:FEW]


async def test_drain_while_the_kv_cache_sleeps_with_a_request_queued_is_refused_instead_of_waiting_forever(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    await engine.sleep(level=1)
    queued = asyncio.create_task(final(engine, PROMPTS[0]))
    await asyncio.sleep(0.05)  # the request is accepted and waits for the wake
    await engine.wake_up(["weights"])
    with pytest.raises(InvalidRequestError, match="drain"):
        async with asyncio.timeout(TIMEOUT):
            await engine.update_weights(ckpt_b, mode="drain")
    await engine.wake_up(["kv_cache"])
    assert list((await queued).token_ids) == ref["A"][0]
    assert engine.weights_version == 0


# ---- 30 streams in flight during a swap ------------------------------------------------------------------
@dataclass
class Stream:
    """One request's outputs: each token with the weights_version it was published under."""

    prompt: int
    tokens: list[tuple[int, int]] = field(default_factory=list)
    last: RequestOutput | None = None

    @property
    def ids(self) -> list[int]:
        return [t for t, _ in self.tokens]

    def before_swap(self, old_version: int) -> list[int]:
        return [t for t, v in self.tokens if v == old_version]


@dataclass
class SwapRun:
    report: dict[str, Any]
    old_version: int
    in_flight: list[Stream]
    late: list[Stream]
    stats: dict[str, Any]


async def consume(engine: AsyncEngine, stream: Stream, progressed: Callable[[], None]) -> Stream:
    async with asyncio.timeout(TIMEOUT):
        async for out in engine.generate(PROMPTS[stream.prompt], greedy()):
            # One token per output, so each token's version is known. Consumers keep up with the
            # steps here; if outputs were ever merged, the per-token versions below would be guesses.
            assert len(out.delta_token_ids) <= 1, f"outputs were merged: {out.delta_token_ids}"
            stream.tokens += [(t, out.weights_version) for t in out.delta_token_ids]
            stream.last = out
            progressed()
    return stream


async def swap_under_load(engine: AsyncEngine, source: Path, mode: str) -> SwapRun:
    """30 greedy streams; once each has 2 tokens, ``update_weights(source, mode)``; while it runs, 5 more."""
    old_version = engine.weights_version
    all_started = asyncio.Event()
    in_flight = [Stream(i) for i in range(NUM_STREAMS)]

    def progressed() -> None:
        if all(len(s.tokens) >= 2 for s in in_flight):
            all_started.set()

    tasks = [asyncio.create_task(consume(engine, s, progressed)) for s in in_flight]
    async with asyncio.timeout(TIMEOUT):
        await all_started.wait()
    update = asyncio.create_task(engine.update_weights(source, mode=mode))
    await asyncio.sleep(0)  # the update runs up to its first wait: admission held or steps paused
    assert not update.done()
    late = [Stream(i) for i in range(NUM_LATE)]
    tasks += [asyncio.create_task(consume(engine, s, lambda: None)) for s in late]
    async with asyncio.timeout(TIMEOUT):
        report = await update
        await asyncio.gather(*tasks)
    return SwapRun(report, old_version, in_flight, late, engine.stats())


@pytest.mark.parametrize("mode", MODES)
async def test_requests_sent_during_a_swap_finish_with_outputs_of_b_and_the_new_version(
    engine: AsyncEngine, mode: str, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    run = await swap_under_load(engine, ckpt_b, mode)
    assert [s.ids for s in run.late] == ref["B"][:NUM_LATE]
    assert all(v == run.old_version + 1 for s in run.late for _, v in s.tokens)


@pytest.mark.parametrize("mode", MODES)
async def test_every_kv_block_is_free_after_a_swap_under_load(engine: AsyncEngine, mode: str, ckpt_b: Path) -> None:
    run = await swap_under_load(engine, ckpt_b, mode)
    assert run.stats["kv_blocks_free"] == run.stats["kv_blocks_total"]
    assert run.stats["requests_running"] == run.stats["requests_waiting"] == 0


async def test_drain_finishes_in_flight_requests_entirely_on_a_with_the_old_version(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    run = await swap_under_load(engine, ckpt_b, "drain")
    assert [s.ids for s in run.in_flight] == ref["A"]
    assert all(v == run.old_version for s in run.in_flight for _, v in s.tokens)
    assert run.report["weights_version"] == run.old_version + 1


async def test_pause_lets_in_flight_requests_finish_with_a_tokens_then_new_version_tokens(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    run = await swap_under_load(engine, ckpt_b, "pause")
    for s in run.in_flight:
        assert s.last is not None and s.last.finish_reason == "length" and len(s.ids) == NEW_TOKENS
        old = s.before_swap(run.old_version)
        assert old == ref["A"][s.prompt][: len(old)]  # computed before the swap: A's
        assert s.ids[len(old) :] and all(v == run.old_version + 1 for _, v in s.tokens[len(old) :])
    # The tokens after the swap came from B: on a random pair of models, at least one departs from A.
    assert any(s.ids != ref["A"][s.prompt] for s in run.in_flight)


async def test_recompute_continues_in_flight_requests_exactly_as_b_would_from_their_a_tokens(
    engine: AsyncEngine, llama_ckpt: Path, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    run = await swap_under_load(engine, ckpt_b, "recompute")
    kept = [s.before_swap(run.old_version) for s in run.in_flight]
    assert kept == [ref["A"][s.prompt][: len(k)] for s, k in zip(run.in_flight, kept, strict=True)]
    # Their KV is recomputed under B, so the rest is HF's greedy of B from prompt + the kept tokens.
    rest = hf_greedy(ckpt_b, [PROMPTS[s.prompt] + k for s, k in zip(run.in_flight, kept, strict=True)],
                     [NEW_TOKENS - len(k) for k in kept])  # fmt: skip
    assert [s.ids for s in run.in_flight] == [k + r for k, r in zip(kept, rest, strict=True)]


async def test_recompute_reports_every_request_it_preempted_mid_generation(engine: AsyncEngine, ckpt_b: Path) -> None:
    run = await swap_under_load(engine, ckpt_b, "recompute")
    mid_generation = [s for s in run.in_flight if len(s.before_swap(run.old_version)) < NEW_TOKENS]
    assert len(mid_generation) > 0
    assert run.report["preempted"] == len(mid_generation)
    assert all(s.last is not None and s.last.num_preemptions >= 1 for s in mid_generation)


async def test_abort_ends_in_flight_requests_with_abort_and_reports_how_many(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    run = await swap_under_load(engine, ckpt_b, "abort")
    ended = [s for s in run.in_flight if s.last is not None and s.last.finish_reason == "abort"]
    finished = [s for s in run.in_flight if s not in ended]
    assert len(ended) > 0 and run.report["aborted"] == len(ended)
    assert all(s.ids == ref["A"][s.prompt][: len(s.ids)] for s in ended)  # cut short, A's so far
    assert all(s.ids == ref["A"][s.prompt] for s in finished)  # any that ended before the swap
