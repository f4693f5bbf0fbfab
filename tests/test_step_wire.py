"""Specification of the step wire (aioengine.worker.step_wire): a model step goes to a worker process as
what changed since the step before, and comes out as the very SchedulerOutput it was.

Driven by the real Scheduler with a fake model (no torch, no process), and by a few steps written by
hand for what the scheduler does rarely. Every step is pickled as the executor pickles it. That greedy
tokens over a real mp engine stay right is tests/test_multiproc_executor.py's (equal to the thread
executor's, with chunked prefill and a block appended while decoding; equal to HF's after a weight swap).
"""

from __future__ import annotations

import pickle
import random
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import cloudpickle  # type: ignore[import-untyped]
import pytest

from aioengine.engine.intake import generation_request
from aioengine.executor.base import execute_and_sample
from aioengine.messages import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from aioengine.sampling.params import SamplingParams
from aioengine.scheduler.request import Request
from aioengine.scheduler.scheduler import Scheduler
from aioengine.worker.process import dumps, run_call
from aioengine.worker.step_wire import KEPT, StepDecoder, StepEncoder, StepMessage

BLOCK_SIZE = 16
EOS = 2


@dataclass
class Wire:
    """An encoder and a decoder joined as the executor joins them: encode, pickle, commit, unpickle, decode.
    Records what kinds of change went over it (``seen``)."""

    encoder: StepEncoder = field(default_factory=StepEncoder)
    decoder: StepDecoder = field(default_factory=StepDecoder)
    seen: Counter[str] = field(default_factory=Counter)
    ever: set[str] = field(default_factory=set)
    last: set[str] = field(default_factory=set)

    def send(self, step: SchedulerOutput) -> tuple[SchedulerOutput, StepMessage, int]:
        """The step as the worker process gets it, the message, and its bytes on the wire."""
        encoded = self.encoder.encode(step)
        data = dumps(encoded.message)
        self.encoder.commit(encoded)
        self._note(step, encoded.message)
        return self.decoder.decode(pickle.loads(data)), encoded.message, len(data)

    def _note(self, step: SchedulerOutput, message: StepMessage) -> None:
        for r, sent in zip(step.requests, message.requests, strict=True):
            drop, tail = sent.blocks
            if r.req_id not in self.last:
                self.seen["came back" if r.req_id in self.ever else "new"] += 1
            elif drop:
                self.seen["block table replaced"] += 1
            elif tail:
                self.seen["block appended"] += 1
            self.seen["sampling kept"] += sent.sampling is KEPT
            self.seen["placeholder"] += PLACEHOLDER_TOKEN_ID in r.token_ids
            self.seen["chunk"] += r.sampling is None
            self.seen["history"] += r.history is not None and r.req_id in self.last
            self.seen["prompt logprobs"] += r.prompt_logprobs is not None
        self.seen["swap"] += bool(step.blocks_to_swap_in or step.blocks_to_swap_out)
        self.seen["copy"] += bool(step.blocks_to_copy)
        self.last = {r.req_id for r in step.requests}
        self.ever |= self.last


def fake_token(r: ScheduledRequest) -> int:
    return 1000 + (r.output_index * 37 + r.sample_index) % 900  # never EOS


def busy_workload() -> list[Request]:
    """Plain, penalised, prompt-logprob and n=2 requests; some prompts longer than a step's budget."""
    rng = random.Random(0)
    kinds: list[dict[str, Any]] = [
        {},
        {"repetition_penalty": 1.2},
        {"prompt_logprobs": 2},
        {"n": 2, "frequency_penalty": 0.5},
        {"presence_penalty": 0.3, "prompt_logprobs": 1},
    ]
    requests = []
    for i in range(15):
        prompt = [rng.randrange(3, 30000) for _ in range(rng.randrange(5, 90))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(20, 60), ignore_eos=True, **kinds[i % 5])
        requests.append(generation_request(prompt, params, f"req-{i}"))
    return requests


# ---- the property --------------------------------------------------------------------------------------
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_every_step_of_a_busy_scheduler_decodes_to_the_step_it_was(preemption_mode: str) -> None:
    s = Scheduler(
        num_cache_blocks=24,  # small: requests are preempted and come back
        block_size=BLOCK_SIZE,
        max_num_seqs=6,
        max_num_batched_tokens=48,  # long prompts take chunks
        max_model_len=256,
        eos_token_ids=[EOS],
        enable_prefix_caching=True,
        preemption_mode=preemption_mode,  # type: ignore[arg-type]
        num_host_blocks=64 if preemption_mode == "swap" else 0,
    )
    for request in busy_workload():
        s.add_request(request)
    wire = Wire()
    in_flight: deque[SchedulerOutput] = deque()  # async scheduling: one step queued behind the one in flight
    for _ in range(2000):
        if not s.has_unfinished_requests() and not in_flight:
            break
        step = s.schedule()
        if not step.is_empty:
            decoded, _, _ = wire.send(step)
            assert decoded == step
            in_flight.append(step)
        if len(in_flight) > 1 or (step.is_empty and in_flight):
            done = in_flight.popleft()
            sampled = [r for r in done.requests if r.sample]
            s.update_from_output(
                done, ModelRunnerOutput(done.step_id, [r.req_id for r in sampled], [fake_token(r) for r in sampled])
            )
    assert not s.has_unfinished_requests(), "the workload did not finish"
    expected = {
        "new", "came back", "block appended", "block table replaced", "sampling kept", "placeholder", "chunk",
        "history", "prompt logprobs", "copy", *(["swap"] if preemption_mode == "swap" else []),
    }  # fmt: skip
    assert expected <= {kind for kind, count in wire.seen.items() if count}, wire.seen


def step_of(*requests: ScheduledRequest, step_id: int = 0) -> SchedulerOutput:
    return SchedulerOutput(step_id, list(requests))


def decoding(
    req_id: str, blocks: list[int], sampling: SamplingParams | None, pos: int = 40, **more: Any
) -> ScheduledRequest:
    return ScheduledRequest(req_id, [PLACEHOLDER_TOKEN_ID], pos, blocks, sampling, output_index=pos - 30, **more)


# ---- what goes over the wire -----------------------------------------------------------------------------
def test_a_block_table_replaced_while_the_request_runs_sends_what_follows_the_shared_part() -> None:
    wire, params = Wire(), SamplingParams()
    wire.send(step_of(decoding("a", [300, 301, 302], params)))
    decoded, message, _ = wire.send(step_of(decoding("a", [300, 301, 410], params, pos=41)))  # copy-on-write
    assert message.requests[0].blocks == (1, [410])
    assert decoded.requests[0].block_ids == [300, 301, 410]
    decoded, message, _ = wire.send(step_of(decoding("a", [500, 501], params, pos=42)))
    assert message.requests[0].blocks == (3, [500, 501])
    assert decoded.requests[0].block_ids == [500, 501]


def test_a_request_absent_from_a_step_is_forgotten_and_sent_whole_when_it_comes_back() -> None:
    wire, params = Wire(), SamplingParams()
    wire.send(step_of(decoding("a", [300, 301], params), decoding("b", [400], params)))
    wire.send(step_of(decoding("b", [400], params, pos=41)))
    decoded, message, _ = wire.send(step_of(decoding("a", [300, 301, 302], params, pos=50)))
    [sent] = message.requests
    assert sent.blocks == (0, [300, 301, 302]) and sent.sampling is params
    assert (sent.start_pos, sent.output_index) == (50, 20)  # counted from nothing again
    assert decoded == step_of(decoding("a", [300, 301, 302], params, pos=50))


def test_sampling_params_are_sent_only_when_they_are_not_the_object_sent_last_time() -> None:
    wire, params = Wire(), SamplingParams(temperature=0.5)
    kinds = []
    for i, sampling in enumerate([params, params, None, params, SamplingParams(temperature=0.5)]):
        decoded, message, _ = wire.send(step_of(decoding("a", [300], sampling, pos=40 + i)))
        assert decoded.requests[0].sampling == sampling
        kinds.append(message.requests[0].sampling)
    assert kinds[:4] == [params, KEPT, None, KEPT]
    assert kinds[4] is not KEPT and kinds[4] is not params


def test_history_goes_as_the_tokens_added_since_last_time() -> None:
    wire, params = Wire(), SamplingParams(repetition_penalty=1.1)
    wire.send(step_of(decoding("a", [300], params, history=[7, 8, 9], num_prompt_tokens=3)))
    decoded, message, _ = wire.send(step_of(decoding("a", [300], params, pos=41, history=[7, 8, 9, 10])))
    assert message.requests[0].history == (0, [10])
    assert decoded.requests[0].history == [7, 8, 9, 10]


def decode_batch(wire: Wire, steps: int, penalties: bool) -> tuple[dict[int, int], dict[int, int], set[int]]:
    """A decode-only batch of 8 requests with 100-token prompts, a block appended every 16 tokens:
    bytes on the wire by step, as plain SchedulerOutputs and as step messages; the steps that append."""
    rng = random.Random(1)
    params = [SamplingParams(max_tokens=5000, **({"repetition_penalty": 1.1} if penalties else {})) for _ in range(8)]
    tokens = [[rng.randrange(300, 30000) for _ in range(100)] for _ in range(8)]
    blocks = [list(range(1000 + 200 * i, 1000 + 200 * i + 7)) for i in range(8)]
    plain, wired, appending = {}, {}, set()
    for n in range(1, steps + 1):
        requests = []
        for i in range(8):
            start = len(tokens[i]) - 1
            if len(blocks[i]) * BLOCK_SIZE < start + 1:
                blocks[i].append(blocks[i][-1] + 1)
                appending.add(n)
            requests.append(
                ScheduledRequest(
                    f"req-{i}", [tokens[i][-1]], start, list(blocks[i]), params[i], output_index=n - 1,
                    history=tokens[i][:start] if penalties else None, num_prompt_tokens=100,
                )
            )  # fmt: skip
            tokens[i].append(rng.randrange(300, 30000))
        step = SchedulerOutput(5000 + 2 * n, requests)
        decoded, _, wired[n] = wire.send(step)
        assert decoded == step
        plain[n] = len(dumps(step))
    return plain, wired, appending


@pytest.mark.parametrize("penalties", [False, True], ids=["plain", "penalties"])
def test_a_decode_step_weighs_no_more_at_step_1000_than_at_step_10(penalties: bool) -> None:
    plain, wired, appending = decode_batch(Wire(), 1000, penalties)
    assert appending and not {10, 1000} & appending, "blocks are appended, but not in the steps compared"
    assert plain[1000] > plain[10] + 8 * 50, "the plain step grows with the context"
    assert wired[1000] <= wired[10]
    assert wired[10] < plain[10] / 4


# ---- staying in step ------------------------------------------------------------------------------------
def test_a_step_that_fails_to_pickle_leaves_the_next_step_decodable() -> None:
    wire, params = Wire(), SamplingParams()
    wire.send(step_of(decoding("a", [300], params)))
    refused = step_of(decoding("a", [300, 301], params, pos=41), step_id=1)
    refused.blocks_to_copy = {301: [threading.Lock()]}  # type: ignore[list-item]
    with pytest.raises(TypeError):
        dumps(wire.encoder.encode(refused).message)  # as the executor: encode, send (fails here), commit
    following = step_of(decoding("a", [300, 301, 302], params, pos=42), step_id=2)
    decoded, message, _ = wire.send(following)
    assert message.requests[0].blocks == (0, [301, 302]), "against the last step sent, not the refused one"
    assert decoded == following


def test_a_step_message_that_never_reached_the_decoder_fails_every_later_step_loudly() -> None:
    encoder, decoder, params = StepEncoder(), StepDecoder(), SamplingParams()
    messages = []
    for i in range(4):
        encoded = encoder.encode(step_of(decoding("a", [300, 301 + i], params, pos=40 + i), step_id=i))
        encoder.commit(encoded)
        messages.append(encoded.message)
    decoder.decode(messages[0])
    for later in messages[2:]:  # messages[1] was lost
        with pytest.raises(RuntimeError, match="out of step"):
            decoder.decode(later)


class FailingOnce:
    """A worker whose first forward raises; it records the steps it is given."""

    def __init__(self) -> None:
        self.steps: list[SchedulerOutput] = []

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(step)
        if len(self.steps) == 1:
            raise RuntimeError("the forward failed")
        return ModelRunnerOutput(step.step_id, [], [])


def test_the_worker_process_decodes_a_step_whose_forward_fails_so_the_next_one_decodes() -> None:
    encoder, decoder, params = StepEncoder(), StepDecoder(), SamplingParams()
    worker = FailingOnce()
    wrapper = SimpleNamespace(rank=0, worker=worker)
    method = cloudpickle.dumps(execute_and_sample)  # as MultiprocExecutor sends a step
    steps = [step_of(decoding("a", [300, 301 + i], params, pos=40 + i), step_id=i) for i in range(2)]
    replies = []
    for call_id, step in enumerate(steps):
        encoded = encoder.encode(step)
        data = dumps((call_id, method, (encoded.message,), {}))
        encoder.commit(encoded)
        reply, _ = run_call(data, wrapper, decoder)  # type: ignore[arg-type]
        replies.append(pickle.loads(reply))
    assert [ok for _, ok, _ in replies] == [False, True]
    assert worker.steps == steps
