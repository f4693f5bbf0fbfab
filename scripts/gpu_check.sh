#!/usr/bin/env bash
# One command for a CUDA machine: the cuda-marked tests, then a short table of figures (graph capture
# time, decode step eager vs graph at batch 1/8/32, greedy parity graph vs eager, sleep / wake, swap
# preemption to pinned memory, tensor parallelism: TP=1 over mp, TP=2 when two devices exist).
# Needs the package importable (pip install -e . or PYTHONPATH=.) and pydantic-settings installed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
status=0
timeout 240 python3 -m pytest -q -m cuda -p no:cacheprovider tests || status=$?
timeout 300 python3 scripts/gpu_check.py || status=$?
exit $status
