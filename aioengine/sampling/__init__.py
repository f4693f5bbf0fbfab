"""Sampling: per-request parameters and the batched sampler."""

from aioengine.sampling.params import SamplingParams
from aioengine.sampling.sampler import Sampler, SamplingMetadata

__all__ = ["Sampler", "SamplingMetadata", "SamplingParams"]
