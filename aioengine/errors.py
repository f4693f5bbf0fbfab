"""Every exception a user of aioengine can see. Each message says what was wrong and what to do."""

from __future__ import annotations


class AIOEngineError(Exception):
    """Base class of all aioengine errors."""


class InvalidRequestError(AIOEngineError, ValueError):
    """A request was refused at submit (empty prompt, ids outside the vocabulary, too long, ...).

    The engine keeps serving every other request.
    """


class RequestTooLargeError(InvalidRequestError):
    """The request can never fit: more tokens than ``max_model_len`` or than the whole KV cache."""


class UnknownModelError(InvalidRequestError):
    """A request names a model the pool (or server) does not serve."""


class UnsupportedModelError(AIOEngineError, ValueError):
    """The checkpoint's architecture (or a feature of it) is not implemented."""


class CheckpointError(AIOEngineError, ValueError):
    """The checkpoint directory is incomplete or its tensors do not match the model."""


class ConfigurationError(AIOEngineError, ValueError):
    """The engine cannot start as configured: no memory for the KV cache, an executor backend that is
    not built yet, tensor parallelism on the thread executor, ... The message names the setting."""


class EngineStateError(AIOEngineError, RuntimeError):
    """The engine is alive but cannot do this now: asleep, paused, or its weights were discarded.

    The message says which state is in the way and the call that leaves it (``wake_up()``,
    ``reload_weights()``, ...); nothing was changed.
    """


class WeightsLostError(CheckpointError):
    """A weight write failed after its first tensor was written (a shard file vanished or was cut short,
    a tensor of a streamed source held NaN / Inf). The weights are a mix, so the engine refuses to run
    a forward on them until a full ``update_weights`` or ``reload_weights`` succeeds."""


class EngineDeadError(AIOEngineError, RuntimeError):
    """The engine stopped (shut down, or its worker failed); it takes no more requests."""


class EngineNotStartedError(AIOEngineError, RuntimeError):
    """The engine was used before ``start()`` (or ``async with``)."""


class RequestAbortedError(EngineDeadError):
    """Raised inside the consumer of a request that was in flight when the engine died or was shut
    down; names the request, and its cause is the engine's error. (A request aborted on purpose, by
    ``abort()`` or an abort mode, ends normally with ``finish_reason == "abort"`` instead.)"""


class ScoreAbortedError(AIOEngineError, RuntimeError):
    """A ``score()`` was aborted on purpose (``abort()``, or the abort mode of a pause, sleep or weight
    update) before every token was rated; nothing partial is returned. Score again."""
