"""Sampling parameters: how one request picks its next tokens and when it stops.

Frozen and validated on construction; a bad value raises :class:`SamplingParamsError` before
anything is scheduled. ``temperature == 0`` means greedy.

``logprobs=k`` returns, for every generated token, its logprob, its rank and the top-k (token id,
logprob) pairs; ``prompt_logprobs=k`` the same for every prompt token after the first. Both are
the model's raw log-softmax over the whole vocabulary: before temperature, top-k / top-p and any
grammar mask (what eval harnesses score against; vLLM's default). ``0`` gives the chosen token's
logprob alone. A request with ``prompt_logprobs`` computes its whole prompt (no prefix-cache or
held-KV hit), since a cached token has no logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentx.engine.structured import StructuredOutput
from agentx.errors import SamplingParamsError

# logits / temperature must stay finite in float32 (|logits| ~ 1e2): 0 means greedy
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20  # top-k pairs a request may ask for (OpenAI's top_logprobs limit)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None  # constrain the output to a grammar
    logprobs: int | None = None  # top-k logprobs of each generated token (None: off)
    prompt_logprobs: int | None = None  # top-k logprobs of each prompt token (None: off)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, bytes | dict) or not hasattr(value, "__iter__"):
                raise SamplingParamsError(f"{name} must be a sequence, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise SamplingParamsError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not (
            self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE
        ):  # NaN and inf fail too; a tiny one overflows the scaled logits to NaN
            raise SamplingParamsError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                f"{MAX_TEMPERATURE:g}], got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingParamsError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise SamplingParamsError(f"seed must be an int or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError(f"stop strings must be non-empty str, got {self.stop!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise SamplingParamsError("structured must be a StructuredOutput")
        if not isinstance(self.ignore_eos, bool) or not isinstance(
            self.include_stop_str_in_output, bool
        ):
            raise SamplingParamsError("ignore_eos and include_stop_str_in_output must be bools")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise SamplingParamsError(
                    f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError(f"stop_token_ids must be ints >= 0: {self.stop_token_ids!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
