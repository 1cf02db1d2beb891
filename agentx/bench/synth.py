"""Synthesize AgentX-shaped traces with the published statistics of agent traffic.

Defaults (``scale=1``) reproduce the published figures (tests/bench/test_bench_synth.py holds each):
a median of 142K input tokens per request, 444 output tokens, 43 root-agent turns per session,
a theoretical prefix hit rate above 96%, and 44% of sessions spawning subagents (median 4).

How: a shared system + tool prompt (4K + 14K tokens, the same blocks in every session), then a
unique task and the history a session starts with (a resumed conversation, instructions and
files read in: median 105K tokens, missed once), then a median of 43 root turns, each turn's
prompt being the previous prompt plus the previous output plus a tool result (median 1K), so
>96% of each prompt was seen before. When a turn would not fit ``max_context_tokens`` the agent
compacts: its context becomes the shared prefix plus new blocks (median 60K: a summary and what
it re-reads), as agents do at their context limit; it is why the median input sits near 142K
(137K over 200 sessions, seed 0) and not at the limit. Think (tool) time passes between turns.
44% of sessions (a Weyl sequence, so any run of sessions hits the fraction) spawn one parallel
group of subagents (median 4 rollouts) whose prompts fork from the parent's context at that
turn; the parent's next turn carries their results.

``scale`` shrinks every input token count by ``scale`` and turn counts by ``sqrt(scale)`` (so a
scaled session keeps a similar shape: many turns, small steps); ``output_scale`` (default:
``scale``) shrinks output lengths on their own, so a CPU-sized trace still decodes turns of ~100
tokens. ``max_context_tokens`` compacts an agent before a turn whose prompt plus output would not
fit the model's context, and ends it when even the compacted prompt would not. Think times are
not scaled (replay caps them with ``--max-think``). Everything is drawn from ``random.Random``
seeded per session by ``(seed, session index)``: same config, same trace, on every machine.

Hash ids identify block content: full blocks keep their id as the context grows; the partial last
block gets a fresh id whenever it changes (its content changed), as in recorded traces.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import asdict, dataclass

from agentx.bench.trace import SessionTrace, Step, Subagent, Trace, TraceRequest
from agentx.errors import ConfigError

_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True, slots=True)
class SynthConfig:
    num_sessions: int = 8
    seed: int = 0
    scale: float = 1.0
    max_context_tokens: int = 200_000
    output_scale: float | None = None  # output lengths x this; None: ``scale``
    block_size: int = 64
    system_tokens: int = 4_000
    tool_tokens: int = 14_000
    median_task_tokens: int = 600
    # what a session's context holds past the shared prefix before its first turn (a resumed
    # conversation, instructions and files read in): unique per session, so it misses once
    median_history_tokens: float = 105_000.0
    history_sigma: float = 0.5
    median_turns: float = 43.0
    turns_sigma: float = 0.6
    median_output_tokens: float = 444.0
    output_sigma: float = 0.8
    median_tool_result_tokens: float = 1_000.0
    tool_result_sigma: float = 0.8
    # what a compacted context keeps past the shared prefix: a summary and what it re-reads
    median_compacted_tokens: float = 60_000.0
    subagent_session_fraction: float = 0.44
    median_subagents: float = 4.0
    subagents_sigma: float = 0.5
    median_subagent_turns: float = 8.0
    median_think_time: float = 2.0  # seconds
    think_sigma: float = 1.0
    min_output_tokens: int = 2

    def __post_init__(self) -> None:
        if self.num_sessions <= 0:
            raise ConfigError(f"num_sessions must be positive, got {self.num_sessions}")
        if not 0 < self.scale <= 1:
            raise ConfigError(f"scale must be in (0, 1], got {self.scale}")
        if self.output_scale is not None and not 0 < self.output_scale <= 1:
            raise ConfigError(f"output_scale must be in (0, 1], got {self.output_scale}")
        if self.max_context_tokens <= self.min_output_tokens:
            raise ConfigError(f"max_context_tokens is too small: {self.max_context_tokens}")
        if not 0 <= self.subagent_session_fraction <= 1:
            raise ConfigError("subagent_session_fraction must be in [0, 1]")

    def tokens(self, n: float) -> int:
        return max(1, round(n * self.scale))

    def output_tokens(self, n: float) -> int:
        scale = self.scale if self.output_scale is None else self.output_scale
        return max(1, round(n * scale))

    def turns(self, n: float) -> int:
        return max(1, round(n * math.sqrt(self.scale)))


class BlockContext:
    """A growing prompt as blocks: full blocks keep their ids, the partial tail is re-minted."""

    def __init__(self, mint: itertools.count, block_size: int) -> None:
        self._mint = mint
        self.block_size = block_size
        self.full: list[int] = []
        self.tail_id: int | None = None
        self.tail_size = 0

    @property
    def num_tokens(self) -> int:
        return len(self.full) * self.block_size + self.tail_size

    def hash_ids(self) -> tuple[int, ...]:
        return (*self.full, self.tail_id) if self.tail_size else tuple(self.full)

    def append(self, n: int) -> None:
        total = self.tail_size + n
        num_full, self.tail_size = divmod(total, self.block_size)
        if num_full:  # the old tail (if any) is completed: new content, new id
            self.full.extend(next(self._mint) for _ in range(num_full))
        self.tail_id = next(self._mint) if self.tail_size else None

    def fork(self) -> BlockContext:
        other = BlockContext(self._mint, self.block_size)
        other.reset_to(self)
        return other

    def reset_to(self, other: BlockContext) -> None:
        self.full, self.tail_id, self.tail_size = list(other.full), other.tail_id, other.tail_size


class _SessionBuilder:
    """Draws one session tree; ``clock`` is the simulated session time in seconds."""

    def __init__(
        self, config: SynthConfig, rng: random.Random, mint: itertools.count, shared: BlockContext
    ) -> None:
        self.c, self.rng, self.mint, self.shared = config, rng, mint, shared
        self.clock = 0.0

    def lognormal(self, median: float, sigma: float) -> float:
        return self.rng.lognormvariate(math.log(median), sigma)

    def request(self, ctx: BlockContext, first: bool) -> TraceRequest | None:
        c = self.c
        out = max(
            c.min_output_tokens,
            c.output_tokens(self.lognormal(c.median_output_tokens, c.output_sigma)),
        )
        out = min(out, c.output_tokens(8 * c.median_output_tokens))
        if ctx.num_tokens + out > c.max_context_tokens:
            self.compact(ctx)
            if ctx.num_tokens + out > c.max_context_tokens:
                return None
        think = 0.0 if first else round(self.lognormal(c.median_think_time, c.think_sigma), 3)
        api_time = round(0.5 + out * 0.02, 3)
        self.clock += think
        request = TraceRequest(
            t=round(self.clock, 3),
            num_input_tokens=ctx.num_tokens,
            num_output_tokens=out,
            hash_ids=ctx.hash_ids(),
            think_time=think,
            api_time=api_time,
            stop="end_turn",
            input_types=("text",),
            output_types=("text",),
        )
        self.clock += api_time
        ctx.append(out)
        return request

    def compact(self, ctx: BlockContext) -> None:
        """The context is full: keep the shared prefix and a summary of the rest (new blocks),
        as agents compact their history; the next prompt misses the cache past the prefix."""
        ctx.reset_to(self.shared)
        ctx.append(self.c.tokens(self.lognormal(self.c.median_compacted_tokens, 0.3)))

    def tool_result(self) -> int:
        c = self.c
        return c.tokens(self.lognormal(c.median_tool_result_tokens, c.tool_result_sigma))

    def agent(self, ctx: BlockContext, num_turns: int, spawn_at: int | None) -> list[Step]:
        steps: list[Step] = []
        for turn in range(num_turns):
            request = self.request(ctx, first=turn == 0)
            if request is None:
                break
            steps.append(request)
            if turn == spawn_at:
                group = self.subagents(ctx)
                steps.extend(group)
                ctx.append(sum(s.steps[-1].num_output_tokens for s in group) + 1)
            else:
                ctx.append(self.tool_result())
        return steps

    def subagents(self, ctx: BlockContext) -> list[Subagent]:
        c, start = self.c, self.clock
        count = max(1, round(self.lognormal(c.median_subagents, c.subagents_sigma)))
        group, end = [], start
        for j in range(count):
            self.clock = start
            sub_ctx = ctx.fork()
            sub_ctx.append(c.tokens(self.lognormal(c.median_task_tokens / 2, 0.5)))
            turns = c.turns(self.lognormal(c.median_subagent_turns, c.turns_sigma))
            steps = self.agent(sub_ctx, turns, spawn_at=None)
            if steps:
                duration = round((self.clock - start) * 1000, 1)
                group.append(
                    Subagent(round(start, 3), f"agent-{j}", tuple(steps), "task", duration)
                )
            end = max(end, self.clock)
        self.clock = end
        return group


def synthesize(config: SynthConfig | None = None) -> Trace:
    c = config or SynthConfig()
    mint = itertools.count(1)
    shared = BlockContext(mint, c.block_size)
    shared.append(c.tokens(c.system_tokens) + c.tokens(c.tool_tokens))
    sessions = []
    offset = random.Random(f"agentx-synth:{c.seed}").random()
    for i in range(c.num_sessions):
        rng = random.Random(f"agentx-synth:{c.seed}:{i}")
        builder = _SessionBuilder(c, rng, mint, shared)
        num_turns = c.turns(builder.lognormal(c.median_turns, c.turns_sigma))
        # a Weyl sequence, not a coin per session: any run of sessions spawns subagents in
        # ``subagent_session_fraction`` of them (within 1/n), and session i's draw is still its own
        spawns = (offset + i * _GOLDEN) % 1.0 < c.subagent_session_fraction and num_turns > 1
        spawn_at = rng.randrange(num_turns - 1) if spawns else None
        ctx = shared.fork()
        ctx.append(c.tokens(builder.lognormal(c.median_task_tokens, 0.5)))
        history = builder.lognormal(c.median_history_tokens, c.history_sigma)
        ctx.append(min(c.tokens(history), c.max_context_tokens // 2))
        steps = builder.agent(ctx, num_turns, spawn_at)
        sessions.append(
            SessionTrace(
                f"session-{i}",
                tuple(steps),
                scope="",
                system_tokens=c.tokens(c.system_tokens),
                tool_tokens=c.tokens(c.tool_tokens),
            )
        )
    trace_id = f"synth-s{c.seed}-n{c.num_sessions}-x{c.scale:g}"
    if c.output_scale is not None:
        trace_id += f"-o{c.output_scale:g}"
    return Trace(trace_id, c.block_size, tuple(sessions), "agentx", meta={"synth": asdict(c)})
