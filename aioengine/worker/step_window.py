"""A decode window on the worker: the steps of a ``SchedulerOutput`` with ``num_steps`` > 1, run back to back, and
their outputs as the one ``ModelRunnerOutput`` the scheduler takes.

Each step after the first is the step before moved on by one position: every row still within its
``ScheduledRequest.num_steps`` computes the token the step before sampled for it (a placeholder: the model runner
moves the last step's batch on where it can, ``WindowBatch``, else fills it as it fills async scheduling's). Each
step goes through the worker's own ``execute_model`` and ``sample_tokens``, so a worker class that overrides them
sees every one. Elsewhere a model that can runs the whole window in one call of its kernels (``Worker.execute_window``,
``window_output``), with the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from aioengine.messages import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput


def run_window(sched: SchedulerOutput, run_step: Callable[[SchedulerOutput], ModelRunnerOutput]) -> ModelRunnerOutput:
    """Runs ``sched``'s window through ``run_step`` (one step: forward, then sampling); returns each row's tokens
    together, in the window's order of rows and steps."""
    tokens: dict[str, list[int]] = {}
    seconds = 0.0
    step, reqs = sched, sched.requests
    for i in range(sched.num_steps):
        if i:
            reqs = [_next(r) for r in reqs if r.num_steps > i]
            step = SchedulerOutput(sched.step_id, reqs)
        output = run_step(step)
        if output.logprobs or output.prompt_logprobs:
            raise RuntimeError("a decode window's rows ask for no logprobs; the scheduler sent a row that does")
        seconds += output.forward_seconds
        for req_id, token in zip(output.req_ids, output.sampled_token_ids, strict=True):
            row = tokens.get(req_id)
            if row is None:
                tokens[req_id] = [token]
            else:
                row.append(token)
    merged = window_output(sched.step_id, tokens.items(), seconds)
    merged.weights_version = output.weights_version
    return merged


def window_output(step_id: int, rows: Iterable[tuple[str, list[int]]], seconds: float) -> ModelRunnerOutput:
    """A window's outputs as one ``ModelRunnerOutput``: each row's tokens (``(req_id, tokens)``) in turn."""
    req_ids: list[str] = []
    sampled: list[int] = []
    for req_id, row in rows:
        req_ids += [req_id] * len(row)
        sampled += row
    return ModelRunnerOutput(step_id, req_ids, sampled, seconds)


def _next(r: ScheduledRequest) -> ScheduledRequest:
    """``r`` one step on: the token its last step sampled, at the next position (no history or prompt logprobs: a
    window's rows ask for neither). Positional, as ``with_token_ids``: a field added to ``ScheduledRequest`` must be
    added here (a test compares the two)."""
    return ScheduledRequest(
        r.req_id,
        [PLACEHOLDER_TOKEN_ID],
        r.start_pos + len(r.token_ids),
        r.block_ids,
        r.sampling,
        r.output_index + 1,
        r.sample_index,
        None,
        r.num_prompt_tokens,
        None,
        r.num_steps,
    )
