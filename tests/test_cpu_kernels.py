"""Specification of the CPU speed paths: the C++ paged decode attention and argmax (``cpu_kernels``), the
kernels' build, and all of them together in the engine (``device.cpu_kernels`` / ``device.cpu_weight_prepack``,
both on by default: greedy tokens equal HF's with them on and off, through a swap and a sleep). The packed
``Linear`` and its GEMM are in ``test_cpu_packed_linear.py``, the prefill attention in
``test_cpu_prefill_attention.py``, the elementwise kernels in ``test_cpu_layer_kernels.py``.

Each is checked against the plain torch path it replaces (``_decode_rows``, ``F.linear``) or against HF
``generate``, never against stored numbers. Caches hold random values everywhere, so a kernel that reads a
wrong slot, or past a row's context, changes the result.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from aioengine import AsyncEngine
from aioengine.messages import ScheduledRequest, SchedulerOutput
from aioengine.model import cpu_kernels
from aioengine.model.attention import _decode_rows, paged_attention
from aioengine.model.linear import Linear
from aioengine.sampling.params import SamplingParams
from aioengine.worker.step_inputs import prepare_inputs
from tests.helpers import final, hf_generate
from tests.weight_swap_support import hf_model

OFF = {"cpu_kernels": False, "cpu_weight_prepack": False}
PROMPTS = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (1, 16, 17, 40, 80)]  # fmt: skip
"""Concurrent prompts of one token, one block, one past a block boundary, and longer."""
NEW_TOKENS = 20


# ---- the paged decode attention kernel ---------------------------------------------------------------
def decode_rows(heads: int, kv_heads: int, dim: int, block_size: int, lengths: list[int],
                seed: int = 0) -> dict[str, torch.Tensor]:  # fmt: skip
    """Decode rows of the given context lengths. Every row's table is full width, of distinct shuffled
    blocks; the entries past a row's context point at blocks of random values the row must not read."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lengths)
    num_blocks = len(lengths) * width + 3
    return {"q": torch.randn(len(lengths), heads, dim, generator=gen),
            "kv_cache": torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen),
            "block_tables": torch.randperm(num_blocks, generator=gen)[: len(lengths) * width].view(-1, width),
            "context_lens": torch.tensor(lengths)}  # fmt: skip


def torch_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float = 0.2) -> torch.Tensor:  # fmt: skip
    width = block_tables.shape[1] * kv_cache.shape[2]
    mask = (torch.arange(width)[None] < context_lens[:, None]).view(len(context_lens), 1, 1, width)
    return _decode_rows(q, kv_cache, block_tables, mask, scale)


def kernel_decode(kernel: ModuleType, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float = 0.2) -> torch.Tensor:  # fmt: skip
    out = torch.full_like(q, float("nan"))  # every element must be written
    kernel.paged_decode_attention(q, kv_cache, block_tables, context_lens, scale, out)
    return out


def test_kernel_builds_wherever_its_tools_are_present_and_computes_what_torch_does(kernel: ModuleType) -> None:
    # The smallest useful call of each kernel: two decode rows over blocks of 4, a 2 x 5 argmax.
    inputs = decode_rows(heads=2, kv_heads=1, dim=8, block_size=4, lengths=[1, 6])
    torch.testing.assert_close(kernel_decode(kernel, **inputs), torch_decode(**inputs), atol=1e-5, rtol=1e-5)
    x = torch.tensor([[0.5, 2.0, -1.0, 2.0, 0.0], [-3.0, -2.0, -2.5, -4.0, -2.0]])
    assert kernel.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [1, 1]  # the first maximum


# Blocks of one register of scores (16), part of one (1, 4) and several (48: three AVX-512 or six AVX2 registers).
@pytest.mark.parametrize("block_size", [16, 1, 4, 48])
@pytest.mark.parametrize("dim", [64, 128, 32, 36])  # the two compiled-in head sizes, two taken at run time
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4), (8, 1), (9, 3)])
def test_kernel_equals_torch_decode_on_shuffled_blocks(kernel: ModuleType, heads: int, kv_heads: int, dim: int,
                                                       block_size: int) -> None:  # fmt: skip
    # One token, exactly one block, one past a boundary, one short of one, the full table width.
    lengths = [1, block_size, 2 * block_size + 1, 3 * block_size - 1, 4 * block_size]
    inputs = decode_rows(heads, kv_heads, dim, block_size, lengths, seed=heads * dim + block_size)
    torch.testing.assert_close(kernel_decode(kernel, **inputs), torch_decode(**inputs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim", [64, 36])
def test_kernel_equals_torch_decode_over_a_large_batch(kernel: ModuleType, dim: int) -> None:
    # Enough rows that a task takes every KV head of its row (a few rows split them across tasks).
    lengths = [1 + (37 * i) % 130 for i in range(96)]
    inputs = decode_rows(9, 3, dim, 16, lengths, seed=dim)
    torch.testing.assert_close(kernel_decode(kernel, **inputs), torch_decode(**inputs), atol=1e-5, rtol=1e-5)


def test_kernel_reads_query_rows_at_any_stride(kernel: ModuleType) -> None:
    # q as the fused qkv projection leaves it: each row's heads contiguous, rows further apart.
    inputs = decode_rows(9, 3, 64, 16, [5, 40, 17], seed=7)
    wide = torch.randn(3, 9 * 64 + 2 * 3 * 64)
    wide[:, : 9 * 64] = inputs["q"].flatten(1)
    strided = {**inputs, "q": wide[:, : 9 * 64].view(3, 9, 64)}
    assert not strided["q"].is_contiguous()
    torch.testing.assert_close(kernel_decode(kernel, **strided), torch_decode(**inputs), atol=1e-5, rtol=1e-5)


BAD_INPUTS: dict[str, tuple[Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], str]] = {
    "context length 0": (lambda a: {**a, "context_lens": a["context_lens"] * 0}, "context length 0 of row 0"),
    "context past the table": (lambda a: {**a, "context_lens": a["context_lens"] + 64}, r"outside 1\.\.64"),
    "block id out of range": (lambda a: {**a, "block_tables": a["block_tables"] + 1000}, r"block id 10\d\d of row 0"),
    "float64": (lambda a: {**a, "q": a["q"].double()}, "float32 only"),
    "non-contiguous": (lambda a: {**a, "q": a["q"].transpose(0, 1).contiguous().transpose(0, 1)}, "contiguous"),
    "head mismatch": (lambda a: {**a, "q": a["q"][:, :3].contiguous()}, "does not match q's heads"),
}


@pytest.mark.parametrize("problem", list(BAD_INPUTS))
def test_kernel_refuses_bad_inputs_naming_the_problem(kernel: ModuleType, problem: str) -> None:
    change, message = BAD_INPUTS[problem]
    with pytest.raises(RuntimeError, match=message):
        kernel_decode(kernel, **change(decode_rows(4, 2, 32, 16, [5, 64, 17])))


def test_kernel_ignores_table_entries_past_the_context(kernel: ModuleType) -> None:
    inputs = decode_rows(4, 2, 32, 4, [3, 16])
    want = kernel_decode(kernel, **inputs)
    inputs["block_tables"][0, 1:] = 10**6  # row 0 uses one block of four
    torch.testing.assert_close(kernel_decode(kernel, **inputs), want, atol=0, rtol=0)


def argmax_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ties = torch.randn(5, 1000, generator=g)
    ties[:, [17, 400, 999]] = ties.max() + 1  # three equal maxima per row: the first wins
    masked = torch.randn(3, 1001, generator=g)  # not a multiple of the kernel's 16 lanes
    masked[0] = float("-inf")  # min_tokens can mask a whole row
    masked[1, :-1] = float("-inf")  # the maximum in the unrolled loop's tail
    return {
        "random": torch.randn(64, 32000, generator=g),
        "ties": ties,
        "masked": masked,
        "one column": torch.randn(4, 1, generator=g),
        "strided": torch.randn(6, 300, generator=g)[:, ::3],
    }


@pytest.mark.parametrize("case", list(argmax_cases()))
def test_argmax_rows_equals_torch_argmax(kernel: ModuleType, case: str) -> None:
    x = argmax_cases()[case]
    assert torch.equal(kernel.argmax_rows(x), x.argmax(dim=-1))


def test_a_failed_build_makes_load_return_none_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    def broken_build() -> ModuleType:
        raise RuntimeError("compiler exploded\nError building extension 'x'")

    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cpu_kernels, "_build", broken_build)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load.__wrapped__() is None  # uncached: the cached load() holds the real build
    assert "Error building extension 'x'" in caplog.text


KERNEL_OF = {"decode_kernel": "paged_decode_attention", "prefill_kernel": "paged_prefill_attention"}
"""``prepare_inputs``' attention kernels, by the kernel module's name for each."""


@pytest.mark.parametrize("path", list(KERNEL_OF))
def test_mixed_batch_from_prepare_inputs_is_the_same_with_and_without_the_kernel(kernel: ModuleType, path: str) -> None:
    # Decodes at contexts 1, 16 (a block boundary) and 41; a prefill chunk continuing at position 20 and one from 0.
    # The chunks' own K and V are written into the cache by paged_attention before either path reads them.
    if not hasattr(kernel, KERNEL_OF[path]):
        pytest.skip(f"the kernels were built without {KERNEL_OF[path]} (AVX-512 and AVX2 builds have it)")
    gen = torch.Generator().manual_seed(3)
    pool = torch.randperm(40, generator=gen).tolist()
    shapes = [(0, 1), (20, 9), (15, 1), (0, 5), (40, 1)]  # (start_pos, tokens)
    reqs = [ScheduledRequest(f"r{i}", [7] * n, start, [pool.pop() for _ in range(-(-(start + n) // 16))], None)
            for i, (start, n) in enumerate(shapes)]  # fmt: skip
    q, k, v = (torch.randn(sum(n for _, n in shapes), heads, 32, generator=gen) for heads in (4, 2, 2))
    cache = torch.randn(2, 40, 16, 2, 32, generator=gen)
    outputs = []
    for attention_kernel in (None, getattr(kernel, KERNEL_OF[path])):
        meta = prepare_inputs(SchedulerOutput(0, reqs), 16, torch.device("cpu"), **{path: attention_kernel}).meta
        assert meta.num_decodes == 3 and len(meta.prefills) == 2 and getattr(meta, path) is attention_kernel
        outputs.append(paged_attention(q, k, v, cache.clone(), meta, 0.3))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)


# ---- through the engine ------------------------------------------------------------------------------
async def greedy(engine: AsyncEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(out.token_ids) for out in await asyncio.gather(*(final(engine, p, params) for p in PROMPTS))]


def linears(worker: Any) -> list[Linear]:
    return [m for m in worker.model_runner.model.modules() if isinstance(m, Linear)]


def speed_paths(worker: Any) -> tuple[bool, bool, bool, bool]:
    """(decode attention runs the C++ kernel, prefill attention does, every Linear runs packed, every Linear
    runs the row-block GEMM) on this worker."""
    runner = worker.model_runner
    assert runner.decode_runner is None or runner.decode_runner.decode_kernel is runner.decode_kernel
    layers = linears(worker)
    return (
        runner.decode_kernel is not None,
        runner.prefill_kernel is not None,
        all(m.prepack_hint is not None for m in layers),
        all(m._row_blocks is not None for m in layers),
    )


def has_gemm(kernel: ModuleType) -> bool:
    """Whether the build has the row-block GEMM (AVX-512 and AVX2 builds)."""
    return hasattr(kernel, "linear_row_blocks")


def has_prefill(kernel: ModuleType) -> bool:
    """Whether the build has the prefill attention (AVX-512 and AVX2 builds)."""
    return hasattr(kernel, "paged_prefill_attention")


@pytest.fixture(scope="module")
def hf_tokens(llama_ckpt: Path) -> list[list[int]]:
    return hf_generate(hf_model(llama_ckpt), PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("switches", ["on", "off", "on, eager"])
async def test_concurrent_greedy_tokens_equal_hf_with_the_speed_paths_on_or_off(
    kernel: ModuleType, make_engine: Callable[..., AsyncEngine], llama_ckpt: Path, hf_tokens: list[list[int]],
    switches: str,
) -> None:  # fmt: skip
    on = switches.startswith("on")
    compile_cfg = {"enforce_eager": switches.endswith("eager")}  # eager: pure decode steps via prepare_inputs too
    async with make_engine(llama_ckpt, device={} if on else OFF, compile=compile_cfg) as engine:
        want = (on, on and has_prefill(kernel), on, on and has_gemm(kernel))
        assert await engine.collective_rpc(speed_paths, unique_reply_rank=0) == want
        assert await greedy(engine) == hf_tokens


def count_lm_head_paths(worker: Any) -> None:
    """Counts, on the worker, the steps whose lm_head ran as logits and those that picked greedy tokens
    without them (``greedy_tokens`` answering)."""
    model = worker.model_runner.model
    counts = worker.lm_head_counts = {"logits": 0, "greedy": 0}

    def counting(original: Callable[..., Any], key: str) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            out = original(*args)
            counts[key] += out is not None
            return out

        return counted

    model.compute_logits = counting(model.compute_logits, "logits")
    model.greedy_tokens = counting(model.greedy_tokens, "greedy")


def lm_head_counts(worker: Any) -> dict[str, int]:
    return dict(worker.lm_head_counts)


@pytest.mark.parametrize("eager", [False, True], ids=["decode runner", "prepare_inputs"])
async def test_greedy_steps_pick_their_tokens_without_computing_the_logits(
    kernel: ModuleType, make_engine: Callable[..., AsyncEngine], llama_ckpt: Path, hf_tokens: list[list[int]],
    eager: bool,
) -> None:  # fmt: skip
    """One rank, the row-block GEMM: a step whose rows are all plain greedy takes the lm_head's fused argmax,
    and the [rows, vocab] logits are never computed; the tokens stay HF's. A request that asks for logprobs
    brings the logits back, with the same tokens."""
    if not has_gemm(kernel):
        pytest.skip("the fused argmax is part of the row-block GEMM (AVX-512 and AVX2 builds)")
    async with make_engine(llama_ckpt, compile={"enforce_eager": eager}) as engine:
        await engine.collective_rpc(count_lm_head_paths)
        assert await greedy(engine) == hf_tokens
        counts = await engine.collective_rpc(lm_head_counts, unique_reply_rank=0)
        assert counts["logits"] == 0 and counts["greedy"] >= NEW_TOKENS
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
        out = await final(engine, PROMPTS[0], params)
        assert list(out.token_ids) == hf_tokens[0] and out.logprobs is not None and len(out.logprobs) == NEW_TOKENS
        after = await engine.collective_rpc(lm_head_counts, unique_reply_rank=0)
        assert after["logits"] >= NEW_TOKENS and after["greedy"] == counts["greedy"]


async def test_engine_without_a_kernel_build_serves_on_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, make_engine: Callable[..., AsyncEngine], llama_ckpt: Path,
    hf_tokens: list[list[int]],
) -> None:  # fmt: skip
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # what load() gives where the build fails
    async with make_engine(llama_ckpt) as engine:
        assert await engine.collective_rpc(speed_paths, unique_reply_rank=0) == (False, False, True, False)
        assert await greedy(engine) == hf_tokens


async def test_update_weights_with_packed_weights_gives_the_new_checkpoints_tokens(
    kernel: ModuleType, make_engine: Callable[..., AsyncEngine], llama_ckpt: Path,
    ckpt_b: Path,
) -> None:  # fmt: skip
    async with make_engine(ckpt_b, device=OFF) as fresh:
        want = await greedy(fresh)
    async with make_engine(llama_ckpt) as engine:
        before = await greedy(engine)
        await engine.update_weights(ckpt_b)
        paths = (True, has_prefill(kernel), True, has_gemm(kernel))
        assert await engine.collective_rpc(speed_paths, unique_reply_rank=0) == paths
        assert await greedy(engine) == want
    assert all(a != b for a, b in zip(before, want, strict=True)), "A and B must disagree for the swap to show"


async def test_sleep_frees_the_packed_weights_and_wake_up_packs_them_again(
    make_engine: Callable[..., AsyncEngine], llama_ckpt: Path, hf_tokens: list[list[int]]
) -> None:
    def packed(worker: Any) -> int:
        layers = linears(worker)
        assert all(m._row_blocks is None for m in layers if m._packed is None)  # no GEMM reads a freed copy
        return sum(m._packed is not None for m in layers)

    async with make_engine(llama_ckpt) as engine:
        total = await engine.collective_rpc(packed, unique_reply_rank=0)
        assert total > 0
        await engine.sleep(1)
        assert await engine.collective_rpc(packed, unique_reply_rank=0) == 0
        await engine.wake_up()
        assert await engine.collective_rpc(packed, unique_reply_rank=0) == total
        assert await greedy(engine) == hf_tokens
