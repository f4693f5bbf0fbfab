"""Sampling: per-request parameters (``params``, pure pydantic) and the batched sampler (``sampler``, torch).

Only the parameters are imported here: the scheduler and the engine read them, and must not load
torch by doing so. The worker imports ``aioengine.sampling.sampler`` itself.
"""

from aioengine.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
