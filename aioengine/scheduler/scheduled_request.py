"""What one step runs for one request: the ``ScheduledRequest`` the scheduler sends for it."""

from __future__ import annotations

from aioengine.messages import PLACEHOLDER_TOKEN_ID, PromptLogprobsSpec, ScheduledRequest
from aioengine.scheduler.request import Request


def describe(request: Request, num_new: int, num_steps: int = 1) -> ScheduledRequest:
    """The step's share of ``request``; advances its computed tokens (and placeholders, if it samples). A decode
    row of a window (``num_steps`` > 1) computes its one token and the ``num_steps - 1`` it samples before the last,
    and samples ``num_steps`` tokens."""
    # Runs for every request every step: locals and positional arguments, no properties.
    start = request.num_computed_tokens
    end = start + num_new
    tokens = request.token_ids
    placeholders = request.num_placeholders
    num_prompt = len(request.prompt_token_ids)
    token_ids = tokens[start:end]
    if len(token_ids) < num_new:  # past the known tokens: the one the step in flight samples
        token_ids += [PLACEHOLDER_TOKEN_ID] * (num_new - len(token_ids))
    samples = end == len(tokens) + placeholders
    params = request.sampling
    scheduled = ScheduledRequest(
        request.req_id,
        token_ids,
        start,
        request.block_ids,  # never changed in place (``KVBlockManager.allocate`` makes a new list)
        params if samples else None,
        len(tokens) - num_prompt + placeholders,  # output_index: tokens generated before this step
        request.sample_index,
        tokens[:start] if samples and params.uses_history else None,
        num_prompt,
        None if request.prompt_logprobs_from is None else prompt_logprobs_spec(request, start, end),
        num_steps,
    )
    request.num_computed_tokens = end + num_steps - 1
    request.num_placeholders = placeholders + samples * num_steps
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
