"""Specification of the greedy screen (``greedy_screen_argmax``, AVX512-BF16 and AVX512-VNNI builds;
``device.cpu_greedy_screen``, on by default): greedy over an lm_head from a copy of its weight in int8 and bfloat16
(the split of the dimensions chosen from the rows screened), the rows it cannot rule out summed in float32. Its
answer is ``linear_row_blocks_argmax``'s bit for bit (the float32 GEMM's first maximum) on every input it answers,
adversarial near-ties included, and it declines (an empty answer, the float32 GEMM then runs) where it cannot vouch
for one. ``Linear.first_max`` keeps the copy in step with the weight and frees it with the packed copy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from aioengine import AsyncEngine
from aioengine.model.greedy_screen import Split, choose_split, int8_error
from aioengine.model.linear import Linear
from tests.helpers import hf_generate, packed_linear, torch_threads
from tests.test_cpu_kernels import NEW_TOKENS, PROMPTS, greedy
from tests.weight_swap_support import hf_model


@pytest.fixture
def screen_kernel(kernel: ModuleType) -> ModuleType:
    if not hasattr(kernel, "greedy_screen_argmax"):
        pytest.skip("the kernels were built without AVX512-BF16 and VNNI: greedy runs the float32 GEMM's argmax")
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


def set_split(layer: Linear, split: str) -> None:
    """The screen's dimensions all in bfloat16, all in int8, or (mixed) every third in bfloat16, the rest in int8
    in an order of their own."""
    screen = layer._screen_object()
    assert screen is not None
    k = layer.in_features
    if split == "bfloat16":
        screen.split = Split.bfloat16(k)
    elif split == "int8":
        screen.split = Split(torch.arange(k), k)
    else:
        wide = torch.arange(k) % 3 == 0
        screen.split = Split(torch.cat([torch.arange(k)[~wide].flip(0), torch.arange(k)[wide]]), int((~wide).sum()))


def answers(kernels: ModuleType, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[Any, Any]:
    screen = layer.greedy_screen_copy()
    copy = layer.row_block_weight()
    assert screen is not None and copy is not None
    address, floats, out_features, stride = copy
    split = screen.split
    args = (x, screen.packed, screen.norms, split.order, split.int8_dims, address, floats, out_features, stride)
    screened = kernels.greedy_screen_argmax(*args, bias)
    # The rows left for float32 read from W itself: the same sums.
    assert torch.equal(kernels.greedy_screen_argmax(*args, bias, layer.weight.detach()), screened)
    exact = kernels.linear_row_blocks_argmax(x, address, floats, out_features, stride, bias)
    return screened, exact


@pytest.mark.parametrize("split", ["bfloat16", "mixed", "int8"])
@pytest.mark.parametrize("case", ["random", "near ties"])
@pytest.mark.parametrize(("out_features", "in_features"), [(3000, 96), (130, 25), (1000, 4500), (200, 7)])
@pytest.mark.parametrize("rows", [1, 13, 64])
def test_the_screen_answers_what_the_float32_gemm_answers(
    screen_kernel: ModuleType, threads: int, out_features: int, in_features: int, rows: int, case: str, split: str
) -> None:
    """Rows off the 6-row tile, an odd K (its last pair padded) and K off int8's quads, columns off the 64-row
    block, a K the float32 GEMM sums in chunks, with and without a bias, each split of the dimensions: the same
    index, and in the near-ties case the screen can not have told the winner by itself."""
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    layer = screened_linear(screen_kernel, out_features, in_features, gen)
    set_split(layer, split)
    x = torch.randn(rows, in_features, generator=gen) * 3
    # int8 leaves few rows for float32 where x has no dimension far above the rest: x there as a trained model's
    # final rows are, their outliers in the dimensions kept in bfloat16 (mixed), or of one magnitude (all int8).
    if split == "mixed":
        x[:, torch.arange(in_features) % 3 == 0] *= 8
    elif split == "int8":
        x = x.sign() * (3 + torch.rand(rows, in_features, generator=gen))
        with torch.no_grad():  # and so are the weight's rows (a normal row's largest value is ~4x its mean)
            layer.weight.copy_(layer.weight.sign() * (0.05 + 0.01 * torch.rand(layer.weight.shape, generator=gen)))
        layer.mark_packed_stale()
    if case == "near ties":
        near_ties(layer, x, gen)
    for bias in (None, torch.randn(out_features, generator=gen) * 1e-3):
        screened, exact = answers(screen_kernel, layer, x, bias)
        assert screened.dtype == torch.int64 and torch.equal(screened, exact)


def test_the_copy_holds_each_weight_rounded_to_bfloat16_and_norms_that_bound_it(screen_kernel: ModuleType) -> None:
    """All in bfloat16: rows off the 64-row block and an odd K (both padded with zeros), values torch rounds to
    bfloat16 the same way (to nearest, ties to even), denormals flushed to zero; the norms of the rows, of their
    rounding errors and of the rounded rows are at least the float64 ones, within a few float32 ulp."""
    gen = torch.Generator().manual_seed(9)
    layer = screened_linear(screen_kernel, 130, 37, gen)
    with torch.no_grad():
        layer.weight[0, :4] = torch.tensor([1e-40, -1e-39, 3.0e38, 1.0 + 2**-8])  # denormals; large; a tie to even
    layer.mark_packed_stale()
    screen = layer.greedy_screen_copy()
    assert screen is not None and screen.split.int8_dims == 0
    pairs = 37 // 2 + 1
    assert screen.packed.shape == (3, pairs + 3, 64)
    words = screen.packed[:, :pairs].to(torch.int64) & 0xFFFFFFFF  # [block, pair, column]
    halves = torch.stack([words & 0xFFFF, words >> 16], dim=-1).to(torch.int32)  # [block, pair, column, k]
    values = (halves << 16).view(torch.float32).permute(0, 2, 1, 3).reshape(-1, 2 * pairs)
    w = layer.weight.detach()
    want = w.to(torch.bfloat16).float()
    want[want.abs() < 2**-126] = 0.0
    assert torch.equal(values[:130, :37], want) and not values[130:].any() and not values[:, 37].any()
    assert values[0, 3] == 1.0  # the tie went to the even neighbour
    wd, err = w.double(), (w.double() - want.double())
    exact = torch.stack([wd.norm(dim=1), err.norm(dim=1), want.double().norm(dim=1), wd.norm(dim=1)])
    assert (screen.norms[:2] <= 2**-149).all()  # no int8 part: zero, rounded up to the least float
    assert (screen.norms[2:].double() >= exact).all()
    torch.testing.assert_close(screen.norms[2:].double(), exact, rtol=1e-6, atol=0)


def test_the_int8_part_holds_each_row_scaled_to_127_and_norms_that_bound_it(screen_kernel: ModuleType) -> None:
    """The dimensions in int8 (in the order given) as q with |q| <= 127, each row's largest value at +-127, q *
    scale within half a step of the weight; the offsets 128 times the sum of the row's q; a row of zeros all 0;
    the norms of the rows' int8 and bfloat16 parts, of their errors and of the whole rows bound the float64 ones."""
    gen = torch.Generator().manual_seed(12)
    layer = screened_linear(screen_kernel, 70, 23, gen)
    with torch.no_grad():
        layer.weight[5] = 0.0
    layer.mark_packed_stale()
    screen = layer._screen_object()
    assert screen is not None
    order = torch.randperm(23, generator=gen)
    screen.split = Split(order, 15)  # four quads, the last padded; 8 dimensions in bfloat16
    copy = layer.greedy_screen_copy()
    assert copy is not None and copy.packed.shape == (2, 4 + 4 + 3, 64)
    words = copy.packed[:, :4]  # [block, quad, column]
    q = torch.stack([(words << (24 - 8 * j)) >> 24 for j in range(4)], dim=-1)  # signed bytes, [block, quad, col, j]
    q = q.permute(0, 2, 1, 3).reshape(128, 16)[:70]
    scale = copy.packed[:, 8].reshape(-1).view(torch.float32)[:70]
    offset = copy.packed[:, 9].reshape(-1)[:70]
    w = layer.weight.detach()[:, order]
    assert not q[:, 15].any() and (q.abs() <= 127).all()
    assert torch.equal(q[:, :15].abs().amax(dim=1)[w[:, :15].abs().amax(dim=1) > 0], torch.full((69,), 127))
    assert not q[5].any() and scale[5] == 0
    rounded = q[:, :15].double() * scale.double()[:, None]
    assert ((rounded - w[:, :15].double()).abs() <= scale.double()[:, None] * 0.5001).all()
    assert torch.equal(offset, 128 * q.sum(dim=1).to(torch.int32))
    wi, wb = w[:, :15].double(), w[:, 15:].double()
    wb_rounded = w[:, 15:].to(torch.bfloat16).double()
    exact = torch.stack([wi.norm(dim=1), (wi - rounded).norm(dim=1), wb.norm(dim=1), (wb - wb_rounded).norm(dim=1),
                         wb_rounded.norm(dim=1), w.double().norm(dim=1)])  # fmt: skip
    assert (copy.norms.double() >= exact).all()
    torch.testing.assert_close(copy.norms.double(), exact, rtol=1e-6, atol=1e-30)
    largest = copy.packed[:, 10, :6].view(torch.float32)  # each block's largest of each norm
    assert torch.equal(largest[0], copy.norms[:, :64].amax(dim=1))
    assert torch.equal(largest[1], copy.norms[:, 64:].amax(dim=1))


@pytest.mark.parametrize("rows", ["concentrated", "spread"])
def test_the_split_is_chosen_from_the_rows_screened(screen_kernel: ModuleType, rows: str) -> None:
    """bfloat16 throughout until 256 rows were seen; then every dimension in int8 where the rows' energy is spread
    (a random-init model's final rows), or the 64 dimensions that hold the most of it in bfloat16 and the rest in
    int8 where those dwarf the others (a trained model's). The copy is made again for the split; the answers are
    the float32 GEMM's either way."""
    gen = torch.Generator().manual_seed(21)
    layer = screened_linear(screen_kernel, 700, 200, gen)
    loud = torch.randperm(200, generator=gen)[:64]
    first = None
    with torch.no_grad():
        for step in range(6):
            x = torch.randn(50, 200, generator=gen)
            if rows == "concentrated":
                x[:, loud] *= 10
            assert torch.equal(layer.first_max(x), layer(x).argmax(dim=-1))
            screen = layer._screen
            assert screen is not None and screen.copy is not None
            if step < 5:  # 250 rows
                assert screen.split.int8_dims == 0
                first = screen.copy.packed
    assert screen.copy.split is screen.split
    if rows == "concentrated":
        assert screen.split.int8_dims == 136 and set(screen.split.order[136:].tolist()) == set(loud.tolist())
        assert screen.copy.packed.shape[1] == 34 + 32 + 3
    else:
        assert screen.split.int8_dims == 200 and torch.equal(screen.split.order, torch.arange(200))
        assert screen.copy.packed.shape[1] == 50 + 0 + 3
    assert first is not None and first.shape[1] == 100 + 3  # all in bfloat16 before


def test_the_split_is_the_cheapest_whose_int8_part_keeps_x_s_error_small() -> None:
    """x's int8 error (|x_I - x~_I| / |x|, rows scaled to 127 by their largest value): under 1% for rows of one
    magnitude, so every dimension goes to int8; a few loud dimensions make it large there but small once they are
    in bfloat16; more loud dimensions than bfloat16 takes leave it large both ways: all in bfloat16."""
    gen = torch.Generator().manual_seed(3)
    spread = torch.randn(256, 2000, generator=gen)
    all_int8 = torch.arange(2000)
    assert int8_error(spread.double(), all_int8) < 0.01
    chosen = choose_split(spread)
    assert chosen.int8_dims == 2000 and torch.equal(chosen.order, all_int8)

    loud = torch.randperm(2000, generator=gen)[:128]
    few = spread.clone()
    few[:, loud[:64]] *= 20
    assert int8_error(few.double(), all_int8) > 0.01
    chosen = choose_split(few)
    assert chosen.int8_dims == 2000 - 64 and set(chosen.order[-64:].tolist()) == set(loud[:64].tolist())
    assert sorted(chosen.order.tolist()) == list(range(2000))

    many = spread.clone()
    many[:, loud] *= 20  # 64 of them stay in int8 whichever 64 go to bfloat16
    chosen = choose_split(many)
    assert chosen.int8_dims == 0 and torch.equal(chosen.order, all_int8)

    zeros = torch.zeros(256, 2000)
    assert int8_error(zeros.double(), all_int8) == 0.0 and choose_split(zeros).int8_dims == 2000


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
    assert layer._screen is not None
    screen = layer._screen.copy
    assert screen is not None and torch.equal(first, layer(x).argmax(dim=-1))
    with torch.no_grad():
        assert torch.equal(layer.first_max(x), first) and layer._screen.copy is screen  # kept while the weight is
        new = torch.randn(500, 48, generator=gen) * 0.05
        with torch_threads(1):  # the thread count the copy was laid out for
            assert layer.write_rows(0, layer.weight, new)  # into the weight and its copy, in place
    with torch.no_grad():
        after = layer.first_max(x)
        remade = layer._screen.copy
        assert remade is not None and remade.generation == layer._generation
        assert remade.packed.data_ptr() == screen.packed.data_ptr()  # rewritten in place
        assert torch.equal(after, torch.nn.functional.linear(x, new).argmax(dim=-1))
    assert not torch.equal(after, first), "the new weight must pick other rows for the test to show"
    layer.drop_packed()
    assert layer._screen.copy is None
    with torch.no_grad():
        assert torch.equal(layer.first_max(x), after) and layer._screen.copy is not None
    layer.set_greedy_screen(False)
    assert layer._screen is None
    with torch.no_grad():
        assert torch.equal(layer.first_max(x), after) and layer._screen is None


@pytest.fixture(scope="module")
def hf_tokens(llama_ckpt: Path) -> list[list[int]]:
    return hf_generate(hf_model(llama_ckpt), PROMPTS, NEW_TOKENS)


def screen_made(worker: Any) -> bool:
    screen = worker.model_runner.model.lm_head._screen
    return screen is not None and screen.copy is not None


async def test_the_engine_screens_greedy_steps_and_keeps_hf_tokens(
    screen_kernel: ModuleType, make_engine: Callable[..., AsyncEngine], llama_ckpt: Path,
    hf_tokens: list[list[int]],
) -> None:  # fmt: skip
    """On by default: greedy steps make and read the copy, the tokens stay HF's; off, none is made, same tokens."""
    for on in (True, False):
        async with make_engine(llama_ckpt, device={"cpu_greedy_screen": on}) as engine:
            assert await greedy(engine) == hf_tokens
            assert await engine.collective_rpc(screen_made, unique_reply_rank=0) is on


def screen_current(worker: Any) -> bool | None:
    """Whether the lm_head's screen copy is made and in step with its weight (None: no greedy step read it yet)."""
    head = worker.model_runner.model.lm_head
    if head._screen is None:
        return None
    copy = head._screen.copy
    return copy is not None and copy.generation == head._generation


async def test_a_weight_write_or_a_wake_makes_the_screen_again_where_greedy_steps_read_it(
    screen_kernel: ModuleType, make_engine: Callable[..., AsyncEngine], llama_ckpt: Path, ckpt_b: Path
) -> None:
    """Where greedy steps read the screen's copy, the write (or wake) that replaces the weight makes the copy again
    inside its own pause: the first greedy step after it runs at its usual cost, and the pause it reports holds
    what the streams wait for. Where none read it since it was made (weights pushed between sampled rollouts), the
    copy is left stale for the next greedy step, if one comes. The new copy picks what the new weights pick."""
    async with make_engine(llama_ckpt) as engine:
        await engine.update_weights(ckpt_b)
        assert await engine.collective_rpc(screen_current, unique_reply_rank=0) is None  # no greedy step yet
        await greedy(engine)
        assert await engine.collective_rpc(screen_current, unique_reply_rank=0) is True
        await engine.update_weights(llama_ckpt)
        assert await engine.collective_rpc(screen_current, unique_reply_rank=0) is True  # made in the write
        await engine.update_weights(ckpt_b)
        assert await engine.collective_rpc(screen_current, unique_reply_rank=0) is False  # unread since: left stale
        await greedy(engine)
        await engine.sleep(1)
        assert await engine.collective_rpc(screen_current, unique_reply_rank=0) is False  # freed with the weights
        await engine.wake_up()
        assert await engine.collective_rpc(screen_current, unique_reply_rank=0) is True  # made in the wake
        tokens_b = await greedy(engine)
    async with make_engine(ckpt_b, device={"cpu_greedy_screen": False}) as reference:
        assert tokens_b == await greedy(reference)
