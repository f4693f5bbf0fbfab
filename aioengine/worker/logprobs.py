"""The logprobs a step answers with: of the tokens it sampled, and of known tokens (a prompt's) it scored."""

from __future__ import annotations

import torch

from aioengine.int_tensors import int64_tensor
from aioengine.messages import LogprobRows, PromptLogprobsSpec, ScheduledRequest
from aioengine.sampling.sampler import gather_logprobs


def _rows(first_pos: int, ids: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor, k: int) -> LogprobRows:
    """``LogprobRows`` of the first ``1 + k`` columns of ``gather_logprobs``'s tensors."""
    return LogprobRows(first_pos, ids[:, : 1 + k].tolist(), values[:, : 1 + k].tolist(), ranks[:, : 1 + k].tolist())


def known_token_logprobs(logits: torch.Tensor, reqs: list[ScheduledRequest]) -> dict[str, LogprobRows]:
    """Logprobs of the known tokens of each request's ``PromptLogprobsSpec``: ``logits`` holds, request after
    request, the rows of the positions before them. Always log-softmax of the model's logits."""
    specs: list[PromptLogprobsSpec] = [r.prompt_logprobs for r in reqs]  # type: ignore[misc]
    chosen = int64_tensor([t for spec in specs for t in spec.token_ids], logits.device)
    k = max(spec.k for spec in specs)
    ids, values, ranks = gather_logprobs(logits.float().log_softmax(dim=-1), chosen, k)
    out = {}
    row = 0
    for req, spec in zip(reqs, specs, strict=True):
        end = row + len(spec.token_ids)
        out[req.req_id] = _rows(spec.first_pos, ids[row:end], values[row:end], ranks[row:end], spec.k)
        row = end
    return out


def asks_logprobs(reqs: list[ScheduledRequest]) -> bool:
    """Whether any of ``reqs`` asked for its sampled token's logprobs."""
    return any(r.sampling is not None and r.sampling.logprobs is not None for r in reqs)


def sampled_logprobs(
    raw: torch.Tensor, processed: torch.Tensor | None, tokens: torch.Tensor, reqs: list[ScheduledRequest]
) -> dict[str, LogprobRows] | None:
    """The sampled tokens' logprobs for the rows that asked, from the raw or the processed logits per row."""
    asked = {i: r.sampling for i, r in enumerate(reqs) if r.sampling is not None and r.sampling.logprobs is not None}
    if not asked:
        return None
    out: dict[str, LogprobRows] = {}
    for mode, source in (("raw", raw), ("processed", processed)):
        ks = {i: p.logprobs for i, p in asked.items() if p.logprobs_mode == mode and p.logprobs is not None}
        if not ks:
            continue
        assert source is not None, "processed logprobs asked for but the sampler kept no processed logits"
        rows = list(ks)
        index = int64_tensor(rows, source.device)
        ids, values, ranks = gather_logprobs(source[index].float().log_softmax(dim=-1), tokens[index], max(ks.values()))
        for j, i in enumerate(rows):
            req = reqs[i]
            position = req.start_pos + len(req.token_ids)
            out[req.req_id] = _rows(position, ids[j : j + 1], values[j : j + 1], ranks[j : j + 1], ks[i])
    return out
