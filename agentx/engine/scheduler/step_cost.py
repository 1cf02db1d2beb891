"""Step cost models: how long the scheduler expects a step to take, from its tokens and requests.

The scheduler keeps decodes from waiting behind long prefill chunks by asking how many tokens one
more request (a chunk) may add to a step that already holds the decoding requests and still end
near a time target. It thinks in tokens and requests only; a model turns those into milliseconds
with a linear estimate::

    step_ms ~= base_ms + token_ms * num_tokens + request_ms * num_requests

``base_ms`` is what every step pays (reading every weight once), ``token_ms`` what each token
adds (the projections' compute), ``request_ms`` what each request adds beyond its tokens
(attention over its context, sampling). A decode is one token and one request; a prefill chunk
is many tokens and one request.

:class:`FixedStepCost` keeps the configured prior (deterministic, for tests). The
:class:`AdaptiveStepCost` fits the measured steps of its engine. Models are pure: the scheduler
measures step times with its own clock and hands them to :meth:`StepCostModel.observe`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from agentx.config import SchedulerConfig
from agentx.errors import ConfigError

# Below this a fitted per-token cost is noise; it also keeps the division in get_num_tokens finite.
_MIN_TOKEN_MS = 1e-6


@dataclass(frozen=True, slots=True)
class StepCost:
    """One linear estimate of a step's time (milliseconds)."""

    base_ms: float
    token_ms: float
    request_ms: float

    def estimate_ms(self, num_tokens: int, num_requests: int) -> float:
        return self.base_ms + self.token_ms * num_tokens + self.request_ms * num_requests

    def get_num_tokens(self, target_ms: float, num_tokens: int, num_requests: int) -> int:
        """Tokens one more request may add to a step of ``num_tokens`` tokens in
        ``num_requests`` requests and still end within ``target_ms`` (0 when none fit)."""
        spare_ms = target_ms - self.estimate_ms(num_tokens, num_requests + 1)
        return max(0, math.floor(spare_ms / self.token_ms))


class StepCostModel(ABC):
    """Estimates step times. Owned by one scheduler, called on its (the engine loop's) thread."""

    @abstractmethod
    def get_cost(self) -> StepCost:
        """The current estimate; no side effects."""

    @abstractmethod
    def observe(self, num_tokens: int, num_requests: int, step_ms: float) -> None:
        """Learn from one executed step of ``num_tokens`` tokens in ``num_requests`` requests that
        took ``step_ms``. Never raises; a model may ignore it."""


class FixedStepCost(StepCostModel):
    """The prior, never updated: the same schedule on every machine."""

    def __init__(self, cost: StepCost) -> None:
        self.cost = cost

    def get_cost(self) -> StepCost:
        return self.cost

    def observe(self, num_tokens: int, num_requests: int, step_ms: float) -> None:
        pass


class AdaptiveStepCost(StepCostModel):
    """Least squares over the measured steps, each step's weight decaying by ``decay`` per
    later step (an EMA of the fit's sums: ~1 / (1 - decay) recent steps count), anchored by the
    previous estimate (at first, the prior).

    The anchor is a light ridge: each coefficient is pulled toward its previous value, scaled by
    how much of a typical step it accounts for (1 ms of base weighs like 1/256 ms per token of a
    256-token chunk, or 1/16 ms per request of 16 decodes). It keeps the fit defined when the
    measured steps do not span all three coefficients: a long run of decode-only steps says
    nothing about what a prefill token costs, so that stays where the last chunks put it
    (instead of decaying back to the prior) while base and per-request costs follow the
    decodes. A few real steps outweigh the anchor wherever they do say something.
    """

    ANCHOR_SCALE = (1.0, 256.0, 16.0)  # (base, per token, per request)

    def __init__(self, prior: StepCost, decay: float = 0.9, prior_weight: float = 0.01) -> None:
        if not 0 < decay < 1 or prior_weight <= 0:
            raise ConfigError(
                f"need 0 < decay < 1 and prior_weight > 0, got {decay}, {prior_weight}"
            )
        self.decay, self.prior_weight = decay, prior_weight
        # the normal equations: gram = sum w x x^T, moment = sum w x y, x = (1, tokens, requests)
        self._gram = [[0.0] * 3 for _ in range(3)]
        self._moment = [0.0] * 3
        self.num_observed = 0
        self._cost = prior

    def get_cost(self) -> StepCost:
        return self._cost

    def observe(self, num_tokens: int, num_requests: int, step_ms: float) -> None:
        if num_tokens <= 0 or not math.isfinite(step_ms) or step_ms < 0:
            return
        for row in self._gram:
            row[:] = [v * self.decay for v in row]
        self._moment[:] = [v * self.decay for v in self._moment]
        _accumulate(self._gram, self._moment, (1.0, num_tokens, num_requests), step_ms, 1.0)
        self.num_observed += 1
        self._cost = self._fit(self._cost)

    def _fit(self, anchor: StepCost) -> StepCost:
        gram = [row[:] for row in self._gram]
        moment = self._moment[:]
        previous = (anchor.base_ms, anchor.token_ms, anchor.request_ms)
        for i, (scale, value) in enumerate(zip(self.ANCHOR_SCALE, previous, strict=True)):
            gram[i][i] += self.prior_weight * scale * scale
            moment[i] += self.prior_weight * scale * scale * value
        base, token, request = _solve3(gram, moment)
        # a noisy fit may swap cost between the coefficients; none of them can be negative
        return StepCost(max(base, 0.0), max(token, _MIN_TOKEN_MS), max(request, 0.0))


def _accumulate(
    gram: list[list[float]], moment: list[float], x: tuple[float, ...], y: float, w: float
) -> None:
    for i in range(3):
        moment[i] += w * x[i] * y
        for j in range(3):
            gram[i][j] += w * x[i] * x[j]


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve the 3x3 system a x = b (a symmetric positive definite: the anchor makes it so),
    Gaussian elimination with partial pivoting."""
    m = [row[:] + [rhs] for row, rhs in zip(a, b, strict=True)]  # (3, 4) augmented
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            m[r] = [v - f * p for v, p in zip(m[r], m[col], strict=True)]
    x = [0.0] * 3
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][c] * x[c] for c in range(r + 1, 3))) / m[r][r]
    return x


STEP_COST_MODELS: dict[str, type[StepCostModel]] = {
    "adaptive": AdaptiveStepCost,
    "fixed": FixedStepCost,
}


def make_step_cost(config: SchedulerConfig) -> StepCostModel:
    """The configured model, starting from the configured prior."""
    prior = StepCost(
        config.step_cost_base_ms, config.step_cost_token_ms, config.step_cost_request_ms
    )
    return STEP_COST_MODELS[config.step_cost_model](prior)
