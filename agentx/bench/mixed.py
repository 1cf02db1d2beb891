"""A mixed trace for first-turn lanes: cold long first turns arriving among warm turns.

    warm-0  [warm-up]-think-[turn]-think-[turn]-think- ... (warm_turns turns)
    warm-1  [warm-up]-think-[turn]-think-[turn]- ...
    cold-0  .......cold_delay.......[ cold_tokens, nothing cached ]
    cold-1  .......cold_delay + cold_interval.......[ cold_tokens ]

Warm sessions share a system prefix of ``system_tokens`` (the same blocks in every warm
session), add a private task of ``task_tokens`` and then send ``warm_turns`` turns; each turn's
prompt is the previous prompt plus its output (``warm_output_tokens``) plus a tool result of
``warm_new_tokens``, so a warm turn computes only those tokens on a cached context. A warm
session's first request (the warm-up) fills its cache and is neither warm nor cold for the
measurement (:func:`request_kind`). Cold session ``i`` sends one request of ``cold_tokens``
tokens that no other request shares, after a think time of ``cold_delay + i * cold_interval``
seconds: replay with ``max_think`` at least that, and with every session live at once
(concurrency ``num_warm_sessions + num_cold_sessions``), and those think times are its
arrival times.

No random draws: every count, length and time is fixed by the config.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from agentx.bench.records import RequestRecord
from agentx.bench.synth import BlockContext
from agentx.bench.trace import SessionTrace, Trace, TraceRequest
from agentx.errors import ConfigError

WARM, WARM_UP, COLD = "warm", "warm-up", "cold"


@dataclass(frozen=True, slots=True)
class MixedConfig:
    num_warm_sessions: int = 4
    warm_turns: int = 10  # turns after the warm-up
    system_tokens: int = 1024
    task_tokens: int = 64
    warm_new_tokens: int = 112  # the tool result each warm turn adds
    warm_output_tokens: int = 16
    warm_think_time: float = 1.0  # seconds between a warm session's turns
    num_cold_sessions: int = 3
    cold_tokens: int = 6144
    cold_output_tokens: int = 8
    cold_delay: float = 8.0  # seconds before the first cold turn (the warm-ups are done)
    cold_interval: float = 10.0  # seconds between cold turns
    block_size: int = 64

    def __post_init__(self) -> None:
        for name in ("num_warm_sessions", "system_tokens", "block_size", "cold_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warm_turns", "task_tokens", "warm_new_tokens", "num_cold_sessions"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("warm_output_tokens", "cold_output_tokens"):
            if getattr(self, name) < 2:
                raise ConfigError(f"{name} must be >= 2 (interactivity needs two tokens)")
        for name in ("warm_think_time", "cold_delay", "cold_interval"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def num_warm_context_tokens(self) -> int:
        """The last warm turn's prompt plus its output: what must fit the model's context."""
        per_turn = self.warm_output_tokens + self.warm_new_tokens
        prompt = self.system_tokens + self.task_tokens + self.warm_turns * per_turn
        return prompt + self.warm_output_tokens

    @property
    def max_think(self) -> float:
        """The longest think time in the trace (replay must not cap it)."""
        last_cold = self.cold_delay + max(0, self.num_cold_sessions - 1) * self.cold_interval
        return max(self.warm_think_time, last_cold if self.num_cold_sessions else 0.0)

    def check_fits(self, max_model_len: int) -> None:
        """Raise ConfigError unless every request plus its output fits ``max_model_len``."""
        longest = max(self.num_warm_context_tokens, self.cold_tokens + self.cold_output_tokens)
        if longest > max_model_len:
            raise ConfigError(
                f"the mixed trace needs {longest} tokens of context, the model has {max_model_len}"
            )


def mixed_trace(config: MixedConfig | None = None) -> Trace:
    c = config or MixedConfig()
    mint = itertools.count(1)
    system = BlockContext(mint, c.block_size)
    system.append(c.system_tokens)
    sessions = [_warm_session(c, i, system.fork()) for i in range(c.num_warm_sessions)]
    for i in range(c.num_cold_sessions):
        ctx = BlockContext(mint, c.block_size)
        ctx.append(c.cold_tokens)
        request = _request(ctx, c.cold_output_tokens, c.cold_delay + i * c.cold_interval)
        sessions.append(SessionTrace(f"cold-{i}", (request,)))
    trace_id = f"mixed-w{c.num_warm_sessions}-c{c.num_cold_sessions}-cold{c.cold_tokens}"
    return Trace(trace_id, c.block_size, tuple(sessions), "agentx", meta={"mixed": asdict(c)})


def _warm_session(c: MixedConfig, index: int, ctx: BlockContext) -> SessionTrace:
    ctx.append(c.task_tokens)
    steps = []
    for turn in range(c.warm_turns + 1):
        steps.append(_request(ctx, c.warm_output_tokens, c.warm_think_time if turn else 0.0))
        ctx.append(c.warm_output_tokens + c.warm_new_tokens)
    return SessionTrace(f"warm-{index}", tuple(steps), system_tokens=c.system_tokens)


def _request(ctx: BlockContext, num_output: int, think: float) -> TraceRequest:
    return TraceRequest(
        t=0.0,
        num_input_tokens=ctx.num_tokens,
        num_output_tokens=num_output,
        hash_ids=ctx.hash_ids(),
        think_time=think,
    )


def request_kind(record: RequestRecord) -> str:
    """``"cold"``, ``"warm-up"`` (a warm session's first request) or ``"warm"``, from the ids
    the replay gives requests (``<agent>#<index>``)."""
    if record.session_id.startswith("cold-"):
        return COLD
    return WARM_UP if record.request_id.endswith("#0") else WARM
