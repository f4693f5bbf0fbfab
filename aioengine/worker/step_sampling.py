"""What a step's sampling rows ask of the sampler: the ids a row may not pick yet (``banned_before_min_tokens``)
and those that end it (``ending_ids``, a decode window's ``window_stop_ids``), whether a step's rows take their raw
argmax and nothing else (``RawArgmaxRows``), and the rows packed as ``SamplingMetadata`` (``sampling_metadata``).
The model runner reads them; the two checks live side by side because the short one must never take a row the
packed metadata would not make an argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aioengine.int_tensors import int64_tensor
from aioengine.messages import ScheduledRequest
from aioengine.sampling.params import RawArgmaxParams, SamplingParams
from aioengine.sampling.sampler import SamplingMetadata


def _short_of_min_tokens(req: ScheduledRequest, params: SamplingParams) -> bool:
    return req.output_index < params.min_tokens


def ending_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The ids that end a row's sequence once it is past ``min_tokens`` (the scheduler's stop check): its stop ids
    and, unless it ignores EOS, the EOS ids."""
    return [*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]


def banned_before_min_tokens(req: ScheduledRequest, eos_token_ids: Sequence[int], vocab_size: int) -> list[int] | None:
    """A row still short of ``min_tokens`` cannot pick EOS or a stop id (as in vLLM): those ids within the vocab."""
    params = req.sampling
    if params is None or not _short_of_min_tokens(req, params):
        return None
    return [t for t in ending_ids(params, eos_token_ids) if t < vocab_size] or None


def window_stop_ids(
    reqs: Sequence[ScheduledRequest], eos_token_ids: Sequence[int], device: torch.device
) -> torch.Tensor | None:
    """[rows, S] int64, -1 padded: each row's ``ending_ids`` (a decode window's rows are all past ``min_tokens``).
    None: no row has any."""
    ends = []
    for r in reqs:
        assert r.sampling is not None
        ends.append(ending_ids(r.sampling, eos_token_ids))
    width = max(map(len, ends), default=0)
    if not width:
        return None
    flat = [t for row in ends for t in (*row, *[-1] * (width - len(row)))]
    return int64_tensor(flat, device).view(len(reqs), width)


class RawArgmaxRows:
    """Whether every row of a step takes the argmax of its raw logits and asks for nothing else: its sampling does
    (``RawArgmaxParams``: plain greedy, no logprobs, judged once per ``SamplingParams`` object), and it is past
    ``min_tokens`` (so ``banned_before_min_tokens`` bans nothing)."""

    def __init__(self, limit: int = 4096) -> None:
        self.takes_it = RawArgmaxParams(limit)

    def all_take_it(self, reqs: Sequence[ScheduledRequest]) -> bool:
        takes_it = self.takes_it
        for req in reqs:
            params = req.sampling
            if params is None or not takes_it(params) or _short_of_min_tokens(req, params):
                return False
        return True


def sampling_metadata(
    reqs: Sequence[ScheduledRequest],
    device: torch.device | str,
    *,
    vocab_size: int,
    eos_token_ids: Sequence[int],
    model_vocab_size: int,
) -> SamplingMetadata:
    """The rows' sampling, packed: ``vocab_size`` the logits' width, ``model_vocab_size`` the vocab the bans are
    checked against."""
    params = [r.sampling for r in reqs]
    assert all(p is not None for p in params)
    return SamplingMetadata.build(
        params,  # type: ignore[arg-type]
        [r.output_index for r in reqs],
        device,
        vocab_size=vocab_size,
        sample_indices=[r.sample_index for r in reqs],
        histories=[(r.history + r.token_ids, r.num_prompt_tokens) if r.history is not None else None for r in reqs],
        banned=[banned_before_min_tokens(r, eos_token_ids, model_vocab_size) for r in reqs],
        processed=any(p is not None and p.logprobs is not None and p.logprobs_mode == "processed" for p in params),
    )
