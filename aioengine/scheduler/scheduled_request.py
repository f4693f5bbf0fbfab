"""What one step runs for one request: the ``ScheduledRequest`` the scheduler sends for it."""

from __future__ import annotations

from aioengine.messages import PLACEHOLDER_TOKEN_ID, PromptLogprobsSpec, ScheduledRequest
from aioengine.scheduler.request import Request


def describe(request: Request, num_new: int) -> ScheduledRequest:
    """The step's share of ``request``; advances its computed tokens (and placeholders, if it samples)."""
    start = request.num_computed_tokens
    end = start + num_new
    known = request.token_ids[start:end]
    samples = end == len(request.token_ids) + request.num_placeholders
    uses_history = samples and request.sampling.uses_history
    scheduled = ScheduledRequest(
        req_id=request.req_id,
        # past the known tokens: the one the step in flight samples
        token_ids=known + [PLACEHOLDER_TOKEN_ID] * (num_new - len(known)),
        start_pos=start,
        block_ids=list(request.block_ids),
        sampling=request.sampling if samples else None,
        output_index=request.num_output_tokens + request.num_placeholders,
        sample_index=request.sample_index,
        history=request.token_ids[:start] if uses_history else None,
        num_prompt_tokens=request.num_prompt_tokens,
        prompt_logprobs=prompt_logprobs_spec(request, start, end),
    )
    request.num_computed_tokens = end
    request.num_placeholders += samples
    return scheduled


def prompt_logprobs_spec(request: Request, start: int, end: int) -> PromptLogprobsSpec | None:
    """The known tokens whose logprobs the step computing ``[start, end)`` can give and nobody has yet:
    those at positions ``start + 1 .. end`` (the last from the step's last logits) within the prompt."""
    if request.prompt_logprobs_from is None:
        return None
    first = max(start + 1, request.prompt_logprobs_from + len(request.prompt_logprobs))
    last = min(end + 1, request.num_prompt_tokens)
    if first >= last:
        return None
    return PromptLogprobsSpec(request.prompt_logprobs_k, first, request.token_ids[first:last])
