"""What a step's sampling rows ask of the sampler: the ids a row may not pick yet (``banned_before_min_tokens``),
whether a step's rows take their raw argmax and nothing else (``RawArgmaxRows``), and the rows packed as
``SamplingMetadata`` (``sampling_metadata``). The model runner reads them; the two checks live
side by side because the short one must never take a row the packed metadata would not make an argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aioengine.messages import ScheduledRequest
from aioengine.sampling.params import RawArgmaxParams, SamplingParams
from aioengine.sampling.sampler import SamplingMetadata


def _short_of_min_tokens(req: ScheduledRequest, params: SamplingParams) -> bool:
    return req.output_index < params.min_tokens


def banned_before_min_tokens(req: ScheduledRequest, eos_token_ids: Sequence[int], vocab_size: int) -> list[int] | None:
    """A row still short of ``min_tokens`` cannot pick EOS or a stop id (as in vLLM): those ids within the vocab."""
    params = req.sampling
    if params is None or not _short_of_min_tokens(req, params):
        return None
    banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
    return [t for t in banned if t < vocab_size] or None


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
