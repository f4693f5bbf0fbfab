"""The OpenAI endpoints: a request body to engine requests, their outputs to an OpenAI response or SSE.

Every engine request is checked and queued (``AsyncEngine.submit``) before the HTTP answer starts, so a
bad one is a 400, never a broken stream. A completion's several prompts are separate engine requests
whose choices are numbered ``prompt_index * n + sample_index`` (OpenAI's order). Streams end with
``data: [DONE]``; an error after the answer started is one ``data: {"error": ...}`` event before it.
Closing a stream (the client went away) aborts every engine request of it at once.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import ValidationError

from aioengine import __version__
from aioengine.engine.outputs import CompletionOutput, RequestOutput
from aioengine.engine.pool import EnginePool
from aioengine.sampling.params import SamplingParams
from aioengine.server import logprobs as logprobs_format
from aioengine.server.errors import APIError, engine_error, validation_error
from aioengine.server.metrics import ServerMetrics
from aioengine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    SamplingFields,
    chat_messages,
)
from aioengine.server.streams import Call, Job, SSEStream, merged, sse


class OpenAIServing:
    """``/v1/completions`` and ``/v1/chat/completions`` over the pool's engines."""

    def __init__(self, pool: EnginePool, metrics: ServerMetrics) -> None:
        self.pool = pool
        self.metrics = metrics

    async def _open(self, model: str) -> Call:
        hold = contextlib.AsyncExitStack()
        try:
            engine = await hold.enter_async_context(self.pool.use(model))
        except BaseException as exc:
            await hold.aclose()
            raise engine_error(exc) if isinstance(exc, Exception) else exc from None
        return Call(engine, hold)

    async def _submit(self, call: Call, model: str, prompt: str | list[int], params: SamplingParams, rid: str,
                      first_choice: int, cache_salt: str | None, prompt_text: str = "") -> None:  # fmt: skip
        ids = await call.engine.tokenize(prompt, request_id=rid)
        stream = await call.engine.submit(ids, params, rid, cache_salt=cache_salt)
        tracker = self.metrics.track(model)
        call.jobs.append(Job(stream, ids, tracker, first_choice, prompt_text))

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
                text = (
                    ""
                    if not body.echo
                    else prompt
                    if isinstance(prompt, str)
                    else logprobs_format.decode(tokenizer, prompt)
                )
                sub = rid if len(prompts) == 1 else f"{rid}-{i}"
                await self._submit(call, body.model, prompt, params, sub, i * body.n, body.cache_salt, text)
        except BaseException as exc:
            raise await _failed(call, exc) from None
        created = int(time.time())
        if body.stream:
            return sse(self._completion_chunks(call, body, rid, created, _include_usage(body)), call)
        await _drain(call)
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
        self, call: Call, body: CompletionRequest, rid: str, created: int, include_usage: bool
    ) -> AsyncIterator[dict[str, Any]]:
        tokenizer = call.engine.tokenizer
        begun: set[int] = set()
        ended: set[int] = set()
        async for job, out in merged(call.jobs):
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
                        logprobs_format.prompt_part(
                            logprobs,
                            out.prompt_logprobs or [],
                            job.prompt_ids,
                            job.prompt_text,
                            body.logprobs,
                            tokenizer,
                        )
                    done = len(o.token_ids) - len(o.delta_token_ids)
                    before = len(job.prompt_text) * body.echo + len(o.text) - len(o.delta_text)
                    logprobs_format.extend(
                        logprobs, (o.logprobs or [])[done:], o.delta_token_ids, body.logprobs, tokenizer, before
                    )
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
            messages = chat_messages(body.messages)
            ids = await call.engine.tokenize(messages=messages, request_id=rid)
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            if max_tokens is None:  # OpenAI's default: as many as the context leaves
                max_len = call.engine.stats().max_model_len or 0
                max_tokens = max(max_len - len(ids), 1)
            top = body.top_logprobs or 0
            params = sampling_params(body, max_tokens=max_tokens, logprobs=top if body.logprobs else None)
            await self._submit(call, body.model, ids, params, rid, 0, body.cache_salt)
        except BaseException as exc:
            raise await _failed(call, exc) from None
        created = int(time.time())
        if body.stream:
            return sse(self._chat_chunks(call, body, rid, created, _include_usage(body)), call)
        await _drain(call)
        job = call.jobs[0]
        choices = [
            ChatChoice(
                index=o.index,
                message=AssistantMessage(content=o.text),
                logprobs=logprobs_format.chat_logprobs(o.logprobs, o.token_ids, top) if body.logprobs else None,
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
        self, call: Call, body: ChatCompletionRequest, rid: str, created: int, include_usage: bool
    ) -> AsyncIterator[dict[str, Any]]:
        exclude = set() if include_usage else {"usage"}
        top = body.top_logprobs or 0
        started: set[int] = set()
        ended: set[int] = set()

        def chunk(job: Job, choice: ChatChunkChoice) -> dict[str, Any]:
            fingerprint = _fingerprint([job])
            c = ChatCompletionChunk(id=rid, created=created, model=body.model, system_fingerprint=fingerprint,
                                    choices=[choice])  # fmt: skip
            return c.model_dump(exclude=exclude)

        async for job, out in merged(call.jobs):
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
                        logprobs = logprobs_format.chat_logprobs(o.logprobs[done:], o.delta_token_ids, top)
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


async def _failed(call: Call, exc: BaseException) -> BaseException:
    """Before the answer started: the engine requests queued so far are aborted, the engine released, and the
    error becomes the HTTP error (a cancellation stays one)."""
    await call.close()
    return engine_error(exc) if isinstance(exc, Exception) else exc


async def _drain(call: Call) -> None:
    """A non-streamed answer: waits for every job's last output."""
    try:
        async for _job, _out in merged(call.jobs):
            pass
    finally:
        await call.close()


def _include_usage(body: SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


# ---- request fields --------------------------------------------------------------------------------------


def sampling_params(
    body: SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
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


def _fingerprint(jobs: Sequence[Job]) -> str:
    """Names the weights a response came from, so a trainer can tell which push produced it."""
    versions = sorted({job.last.weights_version for job in jobs if job.last is not None})
    return f"aioengine-{__version__}-w" + "+".join(map(str, versions or [0]))


def _completion_choice(job: Job, o: CompletionOutput, body: CompletionRequest, tokenizer: Any) -> CompletionChoice:
    text = job.prompt_text + o.text if body.echo else o.text
    logprobs = None
    if body.logprobs is not None:
        logprobs = CompletionLogprobs()
        if body.echo:
            prompt_entries = job.last.prompt_logprobs if job.last is not None else None
            logprobs_format.prompt_part(
                logprobs, prompt_entries or [], job.prompt_ids, job.prompt_text, body.logprobs, tokenizer
            )
        logprobs_format.extend(
            logprobs, o.logprobs or [], o.token_ids, body.logprobs, tokenizer, len(text) - len(o.text)
        )
    return CompletionChoice(
        index=job.first_choice + o.index,
        text=text,
        logprobs=logprobs,
        finish_reason=o.finish_reason,
        stop_reason=o.stop_reason,
    )
