"""The host's speed just before a measured run: one fp32 GEMM, timed in a process of its own.

The 2-core VM these benchmarks were tuned on switches between two speeds every 5-10 s: the same 512x256x1376
``F.linear``, timed back to back for 40 s, ran at ~141 or ~189 GFLOP/s and never between. A run of a second lands in
one spell or the other, so a figure means little without the spell it ran in. ``HostSpeed.probe`` says which: a
1024x2048x2048 GEMM (best of two, ~0.1 s) in a lasting helper process. The GEMM runs in another process because a
thread of the measured one that runs a parallel torch op keeps an OpenMP team, and a process holding more OpenMP
threads than cores has its spin-waits cut short by libgomp: aioengine's runs were 15-25% slower after one such op
on the event loop's thread (``measure_gemm_peak_apart`` keeps the peak out of the process for the same reason).
"""

from __future__ import annotations

import subprocess
import sys

SHAPE = (1024, 2048, 2048)
"""(rows, in features, out features) of the probe's GEMM."""

_CODE = f"""
import sys, time, torch
import torch.nn.functional as F
m, k, n = {SHAPE}
x, w = torch.randn(m, k), torch.randn(n, k)
with torch.inference_mode():
    F.linear(x, w)
    print("ready", flush=True)
    for _ in sys.stdin:
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            F.linear(x, w)
            best = min(best, time.perf_counter() - start)
        print(2 * m * k * n / best / 1e9, flush=True)
"""


class HostSpeed:
    """``with HostSpeed() as speed: speed.probe()`` -> GFLOP/s of the probe's GEMM now, on torch's default threads
    in a helper process that waits, idle, between probes."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> HostSpeed:
        self._process = subprocess.Popen(
            [sys.executable, "-c", _CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._read()  # "ready": torch imported, the GEMM warmed up
        return self

    def __exit__(self, *exc: object) -> None:
        process, self._process = self._process, None
        if process is not None:
            assert process.stdin is not None
            process.stdin.close()  # the helper's loop ends with its input
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def probe(self) -> float:
        """The GEMM's GFLOP/s now."""
        process = self._process
        if process is None or process.stdin is None:
            raise RuntimeError("HostSpeed.probe() outside its with block")
        process.stdin.write("\n")
        process.stdin.flush()
        return float(self._read())

    def _read(self) -> str:
        assert self._process is not None and self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the host-speed probe process ended (exit code {self._process.poll()})")
        return line.strip()
