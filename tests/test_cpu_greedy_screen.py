"""Specification of the bfloat16 greedy screen (``greedy_screen_argmax``, AVX512-BF16 builds;
``device.cpu_greedy_screen``, on by default): greedy over an lm_head from a bfloat16 copy of its weight, the rows
it cannot rule out summed in float32. Its answer is ``linear_row_blocks_argmax``'s bit for bit (the float32
GEMM's first maximum) on every input it answers, adversarial near-ties included, and it declines (an empty
answer, the float32 GEMM then runs) where it cannot vouch for one. ``Linear.first_max`` keeps the copy in step
with the weight and frees it with the packed copy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from aioengine import AsyncEngine
from aioengine.model.linear import Linear
from tests.helpers import hf_generate, packed_linear, torch_threads
from tests.test_cpu_kernels import NEW_TOKENS, PROMPTS, greedy
from tests.weight_swap_support import hf_model


@pytest.fixture
def screen_kernel(kernel: ModuleType) -> ModuleType:
    if not hasattr(kernel, "greedy_screen_argmax"):
        pytest.skip("the kernels were built without AVX512-BF16: greedy runs the float32 GEMM's argmax")
    return kernel


def screened_linear(kernels: Any, out_features: int, in_features: int, gen: torch.Generator) -> Linear:
    """A packed layer in 64-row blocks (packed on one thread) with the screen on, weights of a trained head's scale."""
    with torch_threads(1):
        layer = packed_linear(kernels, out_features, in_features)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.05)
        layer.mark_packed_stale()
        layer.pack()
    assert layer._row_blocks is not None
    layer.set_greedy_screen(True)
    return layer


def near_ties(layer: Linear, x: torch.Tensor, gen: torch.Generator) -> None:
    """Makes the screen's job as hard as it gets: for every row of x, a weight row far above the rest and, at a
    higher index, copies of it changed below bfloat16's resolution (their bfloat16 roundings equal, so the screen
    sees ties) by amounts that move the float32 sums up or down by a few ulp. The float32 sums alone decide."""
    w = layer.weight.detach()
    n = w.shape[0]
    with torch.no_grad():
        for r in range(min(x.shape[0], n // 40)):
            top = x[r].sign() * (1.0 + torch.rand(w.shape[1], generator=gen))
            base = 4 * r
            for j in range(4):
                tweak = (torch.rand(w.shape[1], generator=gen) - 0.5) * 2**-12  # below bfloat16's 2^-7 spacing
                w[(base + 37 * j) % n] = top + (tweak if j else 0)
    layer.mark_packed_stale()
    with torch_threads(1):
        layer.pack()


def answers(kernels: ModuleType, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[Any, Any]:
    screen = layer.greedy_screen_copy()
    copy = layer.row_block_weight()
    assert screen is not None and copy is not None
    address, floats, out_features, stride = copy
    screened = kernels.greedy_screen_argmax(x, *screen, address, floats, out_features, stride, bias)
    exact = kernels.linear_row_blocks_argmax(x, address, floats, out_features, stride, bias)
    return screened, exact


@pytest.mark.parametrize("case", ["random", "near ties"])
@pytest.mark.parametrize(("out_features", "in_features"), [(3000, 96), (130, 25), (1000, 4500), (200, 7)])
@pytest.mark.parametrize("rows", [1, 13, 64])
def test_the_screen_answers_what_the_float32_gemm_answers(
    screen_kernel: ModuleType, threads: int, out_features: int, in_features: int, rows: int, case: str
) -> None:
    """Rows off the 6-row tile, an odd K (its last pair padded), columns off the 64-row block, a K the float32
    GEMM sums in chunks, with and without a bias: the same index, and in the near-ties case the screen can
    not have told the winner by itself."""
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    layer = screened_linear(screen_kernel, out_features, in_features, gen)
    x = torch.randn(rows, in_features, generator=gen) * 3
    if case == "near ties":
        near_ties(layer, x, gen)
    for bias in (None, torch.randn(out_features, generator=gen) * 1e-3):
        screened, exact = answers(screen_kernel, layer, x, bias)
        assert screened.dtype == torch.int64 and torch.equal(screened, exact)


def test_the_copy_holds_each_weight_rounded_to_bfloat16_and_norms_that_bound_it(screen_kernel: ModuleType) -> None:
    """Rows off the 64-row block and an odd K (both padded with zeros), values torch rounds to bfloat16 the same way
    (to nearest, ties to even), denormals flushed to zero; the norms of the rows, of their rounding errors and of
    the rounded rows are at least the float64 ones, within a few float32 ulp."""
    gen = torch.Generator().manual_seed(9)
    layer = screened_linear(screen_kernel, 130, 37, gen)
    with torch.no_grad():
        layer.weight[0, :4] = torch.tensor([1e-40, -1e-39, 3.0e38, 1.0 + 2**-8])  # denormals; large; a tie to even
    layer.mark_packed_stale()
    screen = layer.greedy_screen_copy()
    assert screen is not None
    packed, norms = screen
    words = packed.view(-1, 37 // 2 + 1, 64, 2).to(torch.int32) & 0xFFFF  # [block, pair, column, k of the pair]
    values = (words << 16).view(torch.float32).permute(0, 2, 1, 3).reshape(-1, 38)
    w = layer.weight.detach()
    want = w.to(torch.bfloat16).float()
    want[want.abs() < 2**-126] = 0.0
    assert torch.equal(values[:130, :37], want) and not values[130:].any() and not values[:, 37].any()
    assert values[0, 3] == 1.0  # the tie went to the even neighbour
    exact = torch.stack([w.double().norm(dim=1), (w.double() - want.double()).norm(dim=1), want.double().norm(dim=1)])
    assert (norms.double() >= exact).all()
    torch.testing.assert_close(norms.double(), exact, rtol=1e-6, atol=0)


def test_near_ties_are_decided_by_the_float32_sums(screen_kernel: ModuleType) -> None:
    """A row whose bfloat16 copy equals an earlier row's but whose float32 sum is larger, by a few ulp: found."""
    gen = torch.Generator().manual_seed(5)
    layer = screened_linear(screen_kernel, 640, 64, gen)
    x = torch.ones(1, 64)
    with torch.no_grad():
        layer.weight[10] = 1.0
        layer.weight[600] = 1.0
        layer.weight[600, 3] = 1.0 + 2**-14  # the same bfloat16 (1.0), a float32 sum larger by 2^-14
    layer.mark_packed_stale()
    screened, exact = answers(screen_kernel, layer, x, None)
    assert exact.tolist() == [600] and screened.tolist() == [600]
    with torch.no_grad():
        layer.weight[600, 3] = 1.0  # an exact tie now: the first maximum
    layer.mark_packed_stale()
    screened, exact = answers(screen_kernel, layer, x, None)
    assert exact.tolist() == [10] and screened.tolist() == [10]


@pytest.mark.parametrize("problem", ["nan", "inf", "weights all equal", "too many rows"])
def test_the_screen_declines_what_it_cannot_vouch_for(screen_kernel: ModuleType, problem: str) -> None:
    """Not finite x, a weight whose rows the screen cannot tell apart (every row left for float32), more rows than
    a greedy step has: an empty answer, and ``first_max`` answers with the float32 GEMM."""
    gen = torch.Generator().manual_seed(3)
    layer = screened_linear(screen_kernel, 300, 32, gen)
    x = torch.randn(4, 32, generator=gen)
    if problem == "nan":
        x[1, 2] = float("nan")
    elif problem == "inf":
        x[0, 0] = float("inf")
    elif problem == "weights all equal":
        with torch.no_grad():
            layer.weight.fill_(0.25)
        layer.mark_packed_stale()
    else:
        x = torch.randn(1025, 32, generator=gen)
    screened, exact = answers(screen_kernel, layer, x, None)
    assert screened.numel() == 0
    with torch.no_grad():
        assert torch.equal(layer.first_max(x), exact)


def test_first_max_keeps_the_copy_in_step_with_the_weight(screen_kernel: ModuleType) -> None:
    """Made on the first call; rows written in place (a weight swap) make it again before it is read;
    ``drop_packed`` (sleep) and turning the screen off free it."""
    gen = torch.Generator().manual_seed(11)
    layer = screened_linear(screen_kernel, 500, 48, gen)
    x = torch.randn(6, 48, generator=gen)
    with torch.no_grad():
        first = layer.first_max(x)
    screen = layer._screen
    assert screen is not None and torch.equal(first, layer(x).argmax(dim=-1))
    with torch.no_grad():
        assert torch.equal(layer.first_max(x), first) and layer._screen is screen  # kept while the weight is
        new = torch.randn(500, 48, generator=gen) * 0.05
        with torch_threads(1):  # the thread count the copy was laid out for
            assert layer.write_rows(0, layer.weight, new)  # into the weight and its copy, in place
    with torch.no_grad():
        after = layer.first_max(x)
        assert layer._screen is not None and layer._screen_generation == layer._generation
        assert layer._screen[0].data_ptr() == screen[0].data_ptr()  # rewritten in place
        assert torch.equal(after, torch.nn.functional.linear(x, new).argmax(dim=-1))
    assert not torch.equal(after, first), "the new weight must pick other rows for the test to show"
    layer.drop_packed()
    assert layer._screen is None
    with torch.no_grad():
        assert torch.equal(layer.first_max(x), after) and layer._screen is not None
    layer.set_greedy_screen(False)
    assert layer._screen is None
    with torch.no_grad():
        assert torch.equal(layer.first_max(x), after) and layer._screen is None


@pytest.fixture(scope="module")
def hf_tokens(llama_ckpt: Path) -> list[list[int]]:
    return hf_generate(hf_model(llama_ckpt), PROMPTS, NEW_TOKENS)


def screen_made(worker: Any) -> bool:
    return worker.model_runner.model.lm_head._screen is not None


async def test_the_engine_screens_greedy_steps_and_keeps_hf_tokens(
    screen_kernel: ModuleType, make_engine: Callable[..., AsyncEngine], llama_ckpt: Path,
    hf_tokens: list[list[int]],
) -> None:  # fmt: skip
    """On by default: greedy steps make and read the copy, the tokens stay HF's; off, none is made, same tokens."""
    for on in (True, False):
        async with make_engine(llama_ckpt, device={"cpu_greedy_screen": on}) as engine:
            assert await greedy(engine) == hf_tokens
            assert await engine.collective_rpc(screen_made, unique_reply_rank=0) is on
