"""Decode windows: where every running sequence decodes and takes its raw argmax, one step can run several decode
steps back to back on the workers (``SchedulerOutput.num_steps``), so the step loop's per-step cost (scheduling,
handing the step over, applying and publishing its outputs) is paid once for all of them.

A window is sized by the time its steps take: at most ``max_steps``, and no more than fit in ``budget_s`` at the
speed of the last all-decode step (single steps until one was measured). A request that arrives meanwhile waits
for the window in flight (the engine takes back the one queued behind it, ``EngineCore``), as one waiting for a seat
waits for the window in which a sequence ends, so the budget bounds what windows add to its first token, and to the
gaps of a stream.
"""

from __future__ import annotations

from collections.abc import Sequence

from aioengine.sampling.params import RawArgmaxParams
from aioengine.scheduler.kv_manager import KVBlockManager
from aioengine.scheduler.request import Request


class DecodeWindows:
    """How many decode steps the next step may run (``size``), and the speed that sizes it (``sent``, ``ran``)."""

    def __init__(self, max_steps: int, budget_s: float) -> None:
        if max_steps < 1:
            raise ValueError(f"a decode window runs at least one step; got max_steps={max_steps}")
        self.max_steps = max_steps
        self.budget_s = budget_s
        self.seconds_per_step: float | None = None
        """What one decode step of the last all-decode step took on the workers (None before the first)."""
        self._takes_raw_argmax = RawArgmaxParams()
        self._sent: dict[int, int] = {}
        """Step id -> its steps, for the all-decode steps in flight (their time is what sizes the windows)."""

    def size(self, running: Sequence[Request], admits: bool) -> int:
        """0 where the next step cannot be a window: a waiting request can be admitted (``admits``: a window would
        hold it back; one waiting for a seat is admitted at the end of the window that frees one), or
        a running sequence does more than decode one token and take its raw argmax (plain greedy, no logprobs, past
        ``min_tokens``; no prompt logprobs, no group to fork) or has stop strings (a string found inside a window
        would end its sequence after tokens the window already added). Else its number of steps (1 where the
        budget allows no more); a sequence may run fewer (its length limits)."""
        if self.max_steps == 1 or admits or not running:
            return 0
        takes_it = self._takes_raw_argmax
        for r in running:  # every running sequence, every step: locals, no properties
            params = r.sampling
            known = len(r.token_ids) + r.num_placeholders
            if (
                known - r.num_computed_tokens != 1
                or r.followers
                or r.prompt_logprobs_from is not None
                or not takes_it(params)
                or params.stop
                or known - len(r.prompt_token_ids) < params.min_tokens
            ):
                return 0
        seconds = self.seconds_per_step
        if seconds is None:
            return 1  # a step to measure first: a model whose step takes seconds never runs a window
        return max(1, min(self.max_steps, int(self.budget_s / seconds) if seconds > 0 else self.max_steps))

    def steps_of(
        self, request: Request, window: int, known: int, max_model_len: int, kv: KVBlockManager, rows_after: int
    ) -> int:
        """The steps ``request`` (``known`` tokens once the steps in flight come back) runs in a window of
        ``window``: as many as its length limits leave, its blocks allocated ahead for them. 0 where those blocks
        would leave fewer than one free for each of the ``rows_after`` requests scheduled after it, or are not free:
        the step then runs single, so a window never preempts, and every row but one that ends inside a window runs
        all of it (the worker's placeholders stand for the tokens of the window's last step)."""
        steps = min(window, request.sampling.max_tokens - known + len(request.prompt_token_ids), max_model_len - known)
        if steps <= 1:
            return 1
        start = request.num_computed_tokens
        extra = kv.blocks_for(start + steps) - len(request.block_ids)
        if (extra > 0 and kv.num_free_blocks - extra < rows_after) or not kv.allocate(
            request, start + steps, write_from=start
        ):
            return 0
        return steps

    def sent(self, step_id: int, num_steps: int) -> None:
        """An all-decode step of ``num_steps`` steps was scheduled (``size`` said it could be a window)."""
        self._sent[step_id] = num_steps

    def ran(self, step_id: int, seconds: float) -> None:
        """Step ``step_id`` came back having taken ``seconds`` on the workers."""
        num_steps = self._sent.pop(step_id, 0)
        if num_steps:
            self.seconds_per_step = seconds / num_steps

    def forget(self, step_id: int) -> None:
        """Step ``step_id`` will not come back (revoked before it ran)."""
        self._sent.pop(step_id, None)
