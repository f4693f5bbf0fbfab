"""The OpenAI endpoints: a request body to engine requests, their outputs to an OpenAI response or SSE.

Every engine request is checked and queued (``AsyncEngine.submit``) before the HTTP answer starts, so a
bad one is a 400, never a broken stream. A completion's several prompts are separate engine requests
whose choices are numbered ``prompt_index * n + sample_index`` (OpenAI's order). Streams end with
``data: [DONE]``; an error after the answer started is one ``data: {"error": ...}`` event before it.
Closing a stream (the client went away) aborts every engine request of it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from aioengine import __version__
from aioengine.engine.async_engine import AsyncEngine
from aioengine.engine.outputs import CompletionOutput, Logprob, RequestOutput, RequestStream
from aioengine.engine.pool import EnginePool
from aioengine.sampling.params import SamplingParams
from aioengine.server.errors import APIError, engine_error, validation_error
from aioengine.server.metrics import RequestTracker, ServerMetrics
from aioengine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    TokenLogprob,
    TopLogprob,
    Usage,
    _Sampling,
)

MIN_LOGPROB = -9999.0
"""JSON has no -inf: a token the sampler could not draw (masked, or outside top-k / top-p in "processed"
mode) reports this, as vLLM does."""

SSEStream = AsyncIterator[str]


@dataclass(slots=True)
class _Job:
    """One engine request of an HTTP request."""

    stream: RequestStream
    prompt_ids: list[int]
    tracker: RequestTracker
    first_choice: int
    prompt_text: str = ""
    last: RequestOutput | None = None
    generated: int = 0

    def observe(self, out: RequestOutput) -> None:
        self.last = out
        new = sum(len(o.delta_token_ids) for o in out.outputs)
        if new:
            self.tracker.tokens(new)
        self.generated = sum(len(o.token_ids) for o in out.outputs)
        if out.finished:
            self.tracker.finish(len(self.prompt_ids), self.generated, out.outputs[0].finish_reason or "stop")

    def close(self) -> None:
        self.stream.close()
        self.tracker.finish(len(self.prompt_ids), self.generated, "abort")  # no-op once finished


@dataclass(slots=True)
class _Call:
    """An HTTP request's hold on its engine (``EnginePool.use``) and its engine requests."""

    engine: AsyncEngine
    hold: contextlib.AsyncExitStack
    jobs: list[_Job] = field(default_factory=list)

    async def close(self) -> None:
        for job in self.jobs:
            job.close()
        await self.hold.aclose()

    def usage(self) -> Usage:
        prompt = sum(len(job.prompt_ids) for job in self.jobs)
        completion = sum(job.generated for job in self.jobs)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class OpenAIServing:
    """``/v1/completions`` and ``/v1/chat/completions`` over the pool's engines."""

    def __init__(self, pool: EnginePool, metrics: ServerMetrics) -> None:
        self.pool = pool
        self.metrics = metrics

    async def _open(self, model: str) -> _Call:
        hold = contextlib.AsyncExitStack()
        try:
            engine = await hold.enter_async_context(self.pool.use(model))
        except BaseException as exc:
            await hold.aclose()
            raise engine_error(exc) if isinstance(exc, Exception) else exc from None
        return _Call(engine, hold)

    async def _submit(self, call: _Call, model: str, prompt: str | list[int], params: SamplingParams, rid: str,
                      first_choice: int, cache_salt: str | None, prompt_text: str = "") -> None:  # fmt: skip
        ids = await call.engine.tokenize(prompt, request_id=rid)
        stream = await call.engine.submit(ids, params, rid, cache_salt=cache_salt)
        tracker = self.metrics.track(model)
        call.jobs.append(_Job(stream, ids, tracker, first_choice, prompt_text))

    # ---- completions -----------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest) -> Completion | SSEStream:
        _refuse_unsupported_completion(body)
        prompts = _prompts(body.prompt)
        rid = f"cmpl-{uuid.uuid4().hex}"
        call = await self._open(body.model)
        try:
            params = sampling_params(
                body,
                max_tokens=body.max_tokens,
                logprobs=body.logprobs,
                prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
            )
            tokenizer = call.engine.tokenizer
            for i, prompt in enumerate(prompts):
                text = "" if not body.echo else prompt if isinstance(prompt, str) else _decode(tokenizer, prompt)
                sub = rid if len(prompts) == 1 else f"{rid}-{i}"
                await self._submit(call, body.model, prompt, params, sub, i * body.n, body.cache_salt, text)
        except BaseException as exc:
            await call.close()
            raise engine_error(exc) if isinstance(exc, Exception) else exc from None
        created = int(time.time())
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(self._completion_chunks(call, body, rid, created, include_usage), call)
        try:
            async for _job, _out in _merged(call.jobs):
                pass
        finally:
            await call.close()
        choices = [
            _completion_choice(job, o, body, call.engine.tokenizer) for job in call.jobs for o in _outputs(job.last)
        ]
        return Completion(
            id=rid,
            created=created,
            model=body.model,
            system_fingerprint=_fingerprint(call.jobs),
            choices=sorted(choices, key=lambda c: c.index),
            usage=call.usage(),
        )

    async def _completion_chunks(
        self, call: _Call, body: CompletionRequest, rid: str, created: int, include_usage: bool
    ) -> AsyncIterator[dict[str, Any]]:
        tokenizer = call.engine.tokenizer
        begun: set[int] = set()
        ended: set[int] = set()
        async for job, out in _merged(call.jobs):
            for o in out.outputs:
                index = job.first_choice + o.index
                if index in ended:  # every output repeats the request's finished samples
                    continue
                first = index not in begun
                begun.add(index)
                echo = job.prompt_text if body.echo and first else ""
                logprobs = None
                if body.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    if echo:
                        _prompt_part(logprobs, out.prompt_logprobs or [], job, body.logprobs, tokenizer)
                    done = len(o.token_ids) - len(o.delta_token_ids)
                    before = len(job.prompt_text) * body.echo + len(o.text) - len(o.delta_text)
                    _extend(logprobs, (o.logprobs or [])[done:], o.delta_token_ids, body.logprobs, tokenizer, before)
                text = echo + o.delta_text
                if not text and not o.delta_token_ids and o.finish_reason is None:
                    continue
                if o.finish_reason is not None:
                    ended.add(index)
                choice = CompletionChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=o.finish_reason, stop_reason=o.stop_reason
                )
                chunk = Completion(
                    id=rid, created=created, model=body.model, system_fingerprint=_fingerprint([job]), choices=[choice]
                )
                yield chunk.model_dump(exclude={"usage"} if not include_usage else set())
        if include_usage:
            last = Completion(
                id=rid,
                created=created,
                model=body.model,
                system_fingerprint=_fingerprint(call.jobs),
                choices=[],
                usage=call.usage(),
            )
            yield last.model_dump()

    # ---- chat ------------------------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest) -> ChatCompletion | SSEStream:
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        call = await self._open(body.model)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = await call.engine.tokenize(messages=messages, request_id=rid)
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            if max_tokens is None:  # OpenAI's default: as many as the context leaves
                max_len = call.engine.stats().max_model_len or 0
                max_tokens = max(max_len - len(ids), 1)
            top = body.top_logprobs or 0
            params = sampling_params(body, max_tokens=max_tokens, logprobs=top if body.logprobs else None)
            await self._submit(call, body.model, ids, params, rid, 0, body.cache_salt)
        except BaseException as exc:
            await call.close()
            raise engine_error(exc) if isinstance(exc, Exception) else exc from None
        created = int(time.time())
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(self._chat_chunks(call, body, rid, created, include_usage), call)
        try:
            async for _job, _out in _merged(call.jobs):
                pass
        finally:
            await call.close()
        job = call.jobs[0]
        choices = [
            ChatChoice(
                index=o.index,
                message=AssistantMessage(content=o.text),
                logprobs=_chat_logprobs(o.logprobs, o.token_ids, top) if body.logprobs else None,
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
            )
            for o in _outputs(job.last)
        ]
        return ChatCompletion(
            id=rid,
            created=created,
            model=body.model,
            system_fingerprint=_fingerprint(call.jobs),
            choices=choices,
            usage=call.usage(),
        )

    async def _chat_chunks(
        self, call: _Call, body: ChatCompletionRequest, rid: str, created: int, include_usage: bool
    ) -> AsyncIterator[dict[str, Any]]:
        exclude = set() if include_usage else {"usage"}
        top = body.top_logprobs or 0
        started: set[int] = set()
        ended: set[int] = set()

        def chunk(job: _Job, choice: ChatChunkChoice) -> dict[str, Any]:
            fingerprint = _fingerprint([job])
            c = ChatCompletionChunk(id=rid, created=created, model=body.model, system_fingerprint=fingerprint,
                                    choices=[choice])  # fmt: skip
            return c.model_dump(exclude=exclude)

        async for job, out in _merged(call.jobs):
            for o in out.outputs:
                if o.index in ended:  # every output repeats the request's finished samples
                    continue
                if o.index not in started:
                    started.add(o.index)
                    yield chunk(job, ChatChunkChoice(index=o.index, delta=Delta(role="assistant", content="")))
                if o.delta_text or o.delta_token_ids:
                    logprobs = None
                    if body.logprobs and o.logprobs is not None:
                        done = len(o.token_ids) - len(o.delta_token_ids)
                        logprobs = _chat_logprobs(o.logprobs[done:], o.delta_token_ids, top)
                    delta = Delta(content=o.delta_text)
                    yield chunk(job, ChatChunkChoice(index=o.index, delta=delta, logprobs=logprobs))
                if o.finish_reason is not None:
                    ended.add(o.index)
                    end = ChatChunkChoice(index=o.index, delta=Delta(), finish_reason=o.finish_reason,
                                          stop_reason=o.stop_reason)  # fmt: skip
                    yield chunk(job, end)
        if include_usage:
            fingerprint = _fingerprint(call.jobs)
            last = ChatCompletionChunk(id=rid, created=created, model=body.model, system_fingerprint=fingerprint,
                                       choices=[], usage=call.usage())  # fmt: skip
            yield last.model_dump()


# ---- request fields --------------------------------------------------------------------------------------


def sampling_params(
    body: _Sampling, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    """The engine's ``SamplingParams`` for a request body; OpenAI's defaults where it leaves a field out."""
    bias = None
    if body.logit_bias:
        try:
            bias = {int(token): value for token, value in body.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None
    fields: dict[str, Any] = {
        "n": body.n,
        "max_tokens": max_tokens if max_tokens is not None else 16,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": body.top_k or 0,
        "min_p": body.min_p or 0.0,
        "seed": body.seed,
        "stop": body.stop or [],
        "stop_token_ids": body.stop_token_ids or [],
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "logit_bias": bias,
        "min_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
    }
    try:
        return SamplingParams(**fields)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _refuse_unsupported_completion(body: CompletionRequest) -> None:
    if body.suffix:
        raise APIError(400, "suffix (insertion) is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported; ask for n samples instead", param="best_of")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


# ---- outputs ---------------------------------------------------------------------------------------------


def _outputs(out: RequestOutput | None) -> list[CompletionOutput]:
    return [] if out is None else out.outputs


def _fingerprint(jobs: Sequence[_Job]) -> str:
    """Names the weights a response came from, so a trainer can tell which push produced it."""
    versions = sorted({job.last.weights_version for job in jobs if job.last is not None})
    return f"aioengine-{__version__}-w" + "+".join(map(str, versions or [0]))


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda item: item[1].rank)


def _completion_choice(job: _Job, o: CompletionOutput, body: CompletionRequest, tokenizer: Any) -> CompletionChoice:
    text = job.prompt_text + o.text if body.echo else o.text
    logprobs = None
    if body.logprobs is not None:
        logprobs = CompletionLogprobs()
        if body.echo:
            prompt_entries = job.last.prompt_logprobs if job.last is not None else None
            _prompt_part(logprobs, prompt_entries or [], job, body.logprobs, tokenizer)
        _extend(logprobs, o.logprobs or [], o.token_ids, body.logprobs, tokenizer, len(text) - len(o.text))
    return CompletionChoice(
        index=job.first_choice + o.index,
        text=text,
        logprobs=logprobs,
        finish_reason=o.finish_reason,
        stop_reason=o.stop_reason,
    )


def _decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(token_ids), skip_special_tokens=True))


def _prompt_part(
    into: CompletionLogprobs, entries: Sequence[dict[int, Logprob] | None], job: _Job, k: int, tokenizer: Any
) -> None:
    """The echoed prompt's tokens. Special tokens (BOS) are listed but take no room in the echoed text, so each
    offset points into ``text``; offsets never pass the prompt's end (a token's own text may differ slightly
    from its share of the whole decoded prompt)."""
    _extend(into, entries, job.prompt_ids, k, tokenizer, 0, frozenset(tokenizer.all_special_ids), len(job.prompt_text))


def _extend(
    into: CompletionLogprobs,
    entries: Sequence[dict[int, Logprob] | None],
    token_ids: Sequence[int],
    k: int,
    tokenizer: Any,
    offset: int,
    unprinted: frozenset[int] = frozenset(),
    limit: int | None = None,
) -> None:
    """Appends the legacy layout's parallel lists for ``token_ids``, text offsets counted from ``offset``
    (tokens in ``unprinted`` take no room; no offset passes ``limit``)."""
    for entry, token in zip(entries, token_ids, strict=False):
        chosen = entry.get(token) if entry is not None else None
        text = chosen.decoded_token if chosen is not None else tokenizer.decode([token])
        into.tokens.append(text)
        into.token_logprobs.append(_logprob(chosen.logprob) if chosen is not None else None)
        into.top_logprobs.append(
            {lp.decoded_token: _logprob(lp.logprob) for _, lp in _top(entry, k)} if entry is not None else None
        )
        into.text_offset.append(offset if limit is None else min(offset, limit))
        offset += 0 if token in unprinted else len(text)


def _chat_logprobs(entries: Sequence[dict[int, Logprob]] | None, token_ids: Sequence[int], k: int) -> ChoiceLogprobs:
    content = []
    for entry, token in zip(entries or [], token_ids, strict=False):
        chosen = entry[token]
        top = [
            TopLogprob(token=lp.decoded_token, logprob=_logprob(lp.logprob), bytes=list(lp.decoded_token.encode()))
            for _, lp in _top(entry, k)
        ]
        content.append(
            TokenLogprob(
                token=chosen.decoded_token,
                logprob=_logprob(chosen.logprob),
                bytes=list(chosen.decoded_token.encode()),
                top_logprobs=top,
            )
        )
    return ChoiceLogprobs(content=content)


# ---- streams ---------------------------------------------------------------------------------------------


async def _merged(jobs: Sequence[_Job]) -> AsyncIterator[tuple[_Job, RequestOutput]]:
    """Every job's outputs as they come (one job: in place; several: interleaved through a queue)."""
    if len(jobs) == 1:
        async for out in jobs[0].stream:
            jobs[0].observe(out)
            yield jobs[0], out
        return
    queue: asyncio.Queue[tuple[_Job, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(job: _Job) -> None:
        try:
            async for out in job.stream:
                queue.put_nowait((job, out))
        except Exception as exc:
            queue.put_nowait((job, exc))
        finally:
            queue.put_nowait((job, None))

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            job, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                job.observe(item)
                yield job, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sse(chunks: AsyncIterator[dict[str, Any]], call: _Call) -> SSEStream:
    """Server-sent events as OpenAI sends them; the engine requests end when this does (or is closed)."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"
    except Exception as exc:  # the answer has started: the error becomes the stream's last event
        yield f"data: {json.dumps(engine_error(exc).body())}\n\n"
    finally:
        await call.close()
    yield "data: [DONE]\n\n"
