"""The agentx exception tree.

Every error agentx raises on purpose derives from :class:`AgentXError`::

    AgentXError
    ├── ConfigError            a config value is invalid (raised once, when the config is built)
    ├── ModelNotFoundError     the model path or the default model package is missing
    ├── ModelLoadError         the checkpoint cannot be read (bad file, unknown architecture)
    ├── InvalidRequestError    a request is rejected before anything is scheduled
    │   ├── PromptTooLongError     longer than the model context or than the KV pool can ever hold
    │   ├── SamplingParamsError    a bad sampling value (temperature, top_p, max_tokens, ...)
    │   └── ToolArgumentsError     a tool call's arguments do not match the tool's schema
    │                              (defined in agentx.session.tools; its message is for the model)
    ├── RequestAbortedError    the request was aborted (by the caller or by cancellation)
    ├── RequestFailedError     the request ran and failed (finish_reason "error": its grammar
    │                          rejected a token or hit llguidance's limits); ``output`` holds
    │                          its last delta
    ├── EngineClosedError      a request arrived after the engine was closed
    ├── EngineDeadError        the engine loop crashed; every waiting request fails with this
    │   └── InstanceDeadError      a prefill or decode instance's process of a P/D coordinator
    │                              died: its requests fail with this, the others keep running
    ├── KVPolicyError          a user KV policy raised or returned an invalid decision (the
    │                          decision is refused before the cache changes; ``__cause__``
    │                          holds what the policy raised)
    ├── OffloadError           an offload tier cannot start (mooncake_master missing, not ready,
    │                          or asked to start outside a private network namespace)
    ├── TraceError             a benchmark trace file is invalid (names the file, the record and
    │                          the field; also a ValueError)
    ├── SessionError           misuse of a Session
    │   ├── SessionClosedError     the session (or its parent) was closed
    │   ├── TurnInProgressError    a second turn while one is open on the same session
    │   └── UnknownToolCallError   a tool result for a call id the model did not make (also
    │                              an InvalidRequestError)
    └── KernelFallbackWarning  a warning category, never raised (also a RuntimeWarning): the
                               compiled CPU kernels were wanted but could not build or load (no
                               compiler, a failed build, a CPU without AVX2), so every op runs
                               on the much slower reference kernels; issued once per process

``InvalidRequestError``, ``ConfigError`` and ``TraceError`` are also ``ValueError`` so that code
that already catches ``ValueError`` for bad input keeps working.

Bad input never reaches the engine loop thread: requests, options, hints (``ToolLatency``
seconds must be finite and at most a day) and sampling values are checked on the caller's
thread, so one bad request cannot kill the engine for every other caller.
"""

from __future__ import annotations

import warnings

__all__ = [
    "AgentXError",
    "ConfigError",
    "EngineClosedError",
    "EngineDeadError",
    "InstanceDeadError",
    "InvalidRequestError",
    "KVPolicyError",
    "KernelFallbackWarning",
    "ModelLoadError",
    "ModelNotFoundError",
    "OffloadError",
    "PromptTooLongError",
    "RequestAbortedError",
    "RequestFailedError",
    "SamplingParamsError",
    "SessionClosedError",
    "SessionError",
    "TraceError",
    "TurnInProgressError",
    "UnknownToolCallError",
]


class AgentXError(Exception):
    """Base class of every error agentx raises on purpose."""


class ConfigError(AgentXError, ValueError):
    """A configuration value is invalid."""


class ModelNotFoundError(AgentXError, FileNotFoundError):
    """The model path does not exist, or the default model package is not installed."""


class ModelLoadError(AgentXError):
    """The checkpoint exists but cannot be loaded."""


class InvalidRequestError(AgentXError, ValueError):
    """A request is rejected before it is scheduled."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus room to generate) exceeds the model context or the KV pool."""


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range."""


class RequestAbortedError(AgentXError):
    """The request was aborted before it finished."""


class RequestFailedError(AgentXError):
    """The request ran and failed (``finish_reason == "error"``, ``stop_reason`` says why:
    "grammar_error"); a request that cannot be served is refused at submit instead. The
    stream, ``result()`` and ``generate`` raise it after the deltas before the failure;
    ``output`` is the final delta (None when rebuilt from a pickle)."""

    def __init__(self, message: str, output: object | None = None) -> None:
        super().__init__(message)
        self.output = output

    def __reduce__(self):  # crosses process pipes: the message only
        return (type(self), (str(self),))


class EngineClosedError(AgentXError):
    """The engine was closed; it takes no new requests."""


class EngineDeadError(AgentXError):
    """The engine loop raised; the engine cannot serve any more requests.

    ``__cause__`` holds the original exception.
    """


class InstanceDeadError(EngineDeadError):
    """A P/D instance's engine process died (engine/disagg/): the requests it ran or was
    handing over fail with this; ``instance`` names it ("prefill-0", "decode-1"). The
    coordinator routes later requests to the instances still alive."""

    def __init__(self, message: str, instance: str = "") -> None:
        super().__init__(message)
        self.instance = instance

    def __reduce__(self):  # crosses process pipes: keep ``instance``
        return (type(self), (str(self), self.instance))


class TraceError(AgentXError, ValueError):
    """A benchmark trace file cannot be read: the message names the file, the record and the
    field (``trace.json: requests[3].hash_ids: expected a list of ints``)."""


class SessionError(AgentXError):
    """A Session was used in a way its lifecycle does not allow."""


class SessionClosedError(SessionError):
    """The session, or the parent it was forked from, is closed."""


class TurnInProgressError(SessionError):
    """A turn is already open on this session; sessions run one turn at a time."""


class UnknownToolCallError(SessionError, InvalidRequestError):
    """A tool result names a call id that no assistant message of this session made."""


class KVPolicyError(AgentXError):
    """A KV policy hook raised or returned something its contract does not allow.

    ``policy`` and ``hook`` name where; the cache is unchanged by the refused decision. With
    ``CacheConfig(kv_policy_errors="fallback")`` (the default) the engine logs it, counts it in
    ``EngineStats.kv_policy_errors`` and applies the built-in decision instead; with "raise" it
    propagates (from the engine loop: the engine stops with ``EngineDeadError`` caused by it).
    """

    def __init__(self, message: str, policy: str = "", hook: str = "") -> None:
        super().__init__(message)
        self.policy = policy
        self.hook = hook


class OffloadError(AgentXError):
    """An offload tier cannot start; a running tier never raises, it misses and skips."""


class KernelFallbackWarning(AgentXError, RuntimeWarning):
    """The compiled CPU kernels fell back to the reference kernels (``warnings.warn`` category;
    ``-W error::agentx.errors.KernelFallbackWarning`` makes the fallback fatal)."""


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that a public name was renamed; the old one keeps working until it is removed.
    ``stacklevel`` 3 names the caller of the function that calls this one."""
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=stacklevel)
