"""aioengine's C++ kernels for CPU, built on first use with torch's extension builder and cached.

``csrc/`` holds them, one file per kind (``csrc/module.cpp`` lists them all): paged decode attention,
which reads K and V in place through the block tables instead of gathering the context into a copy first
(what makes decode attention cheap on CPU; ``attention.cpp``), and in AVX-512 and AVX2 builds the causal
attention of a prompt chunk (``prefill_attention.cpp``); ``argmax_rows`` for greedy sampling and the fused
elementwise layers ``rms_norm``, ``add_rms_norm`` (the residual add and the norm after it in one pass),
``rotary_inplace`` and ``silu_and_mul`` (``elementwise.cpp``); the in-place rewrite of oneDNN-reordered
weights on a swap and its check (``packed_weights.cpp``) and, in AVX-512 and AVX2 builds, the GEMM that
reads them and its greedy form, each row's first maximum without the output (``packed_linear.cpp``), and
a step's decoder layers in one call (``decoder_layer.cpp``). The kernels split their work over torch's threads
in tasks that a thread done with its own share takes from the others (``parallel_tasks`` in ``common.h``).
The plain torch paths (``attention.py``, ``torch.argmax``, the layers' own torch code) stay as the fallback
and the reference they are tested against.

The build needs a C++ compiler and ninja; it takes about half a minute once, then loads from torch's
extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) in milliseconds.
It is compiled for this CPU (``-march=native``), so the build's name carries a hash of the CPU's
model and flags: a cache shared between different machines never hands one the other's build. It also
carries a hash of the headers, which torch's builder does not look at.
Without a compiler, or if the build fails, ``load()`` returns None once with a warning naming the
reason, and the engine runs the torch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [
    _CSRC / name
    for name in (
        "module.cpp",
        "attention.cpp",
        "prefill_attention.cpp",
        "elementwise.cpp",
        "packed_weights.cpp",
        "packed_linear.cpp",
        "greedy_screen.cpp",
        "decoder_layer.cpp",
        "decode_window.cpp",
    )
]
_HEADERS = [_CSRC / "common.h", _CSRC / "kernels.h"]
# Vectorised reductions without -ffast-math (which may link crtfastmath and set flush-to-zero for the
# whole process).
_CFLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-fopenmp",
]
_lock = threading.Lock()


def _headers_fingerprint() -> str:
    """A hash of the headers: torch rebuilds when a source or a flag changes, not when a header does."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in _HEADERS)).hexdigest()[:8]


def _cpu_fingerprint() -> str:
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text += "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def unavailable_reason() -> str | None:
    """Why the kernels cannot be built here (checked without building), or None."""
    if platform.system() != "Linux":
        return f"CPU kernels are built on Linux only (this is {platform.system()})"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (c++ or g++) on PATH"
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja)"
    return None


@functools.cache
def load() -> ModuleType | None:
    """The built kernel module, or None (with one warning) where it cannot be built. Thread-safe."""
    with _lock:
        reason = unavailable_reason()
        if reason is None:
            try:
                return _build()
            except Exception as exc:  # a failed build must not stop the engine: the torch path is correct
                reason = f"the build failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
        logger.warning(
            "aioengine CPU kernels unavailable (%s); decode attention and argmax run the slower torch paths", reason
        )
        return None


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load as load_extension

    logger.info("loading aioengine's CPU kernels (the first run on a machine builds them: about 30 s)")
    start = time.perf_counter()
    module = load_extension(
        f"aioengine_cpu_kernels_{_cpu_fingerprint()}_{_headers_fingerprint()}",
        [str(p) for p in _SOURCES],
        extra_cflags=_CFLAGS,
        verbose=False,
    )
    seconds = time.perf_counter() - start
    if seconds > 2:
        logger.info("built aioengine's CPU kernels in %.1fs (cached for next time)", seconds)
    return module
