"""A custom KV policy: keep every session's system prompt, release the biggest idle KV first.

Four sessions share one long system prompt and take turns on an engine whose KV pool is too
small to hold them all. The policy (``agentx.KVPolicy``; its hooks have the built-in behaviour
as defaults, so it overrides only two):

1. ``on_turn_end``: soft-pin the blocks of the shared system prompt: they are evicted after
   every other cached block, so each new session finds the prompt on the device;
2. ``choose_evictions``: when held KV must go to make room, release first the session with the
   most blocks times the most turns since it last ran (the built-in order is plain LRU).

``--broken`` swaps in a policy that answers nonsense: the engine refuses each answer before it
reaches the cache, applies the built-in decision instead and counts the error
(``EngineStats.kv_policy_errors``); the cache's invariants still hold (``check_integrity``).

Run with ``python examples/kv_policy.py``; about 30 s on a 2-core CPU.
"""

from __future__ import annotations

import argparse

import anyio

from agentx import (
    CacheConfig,
    Engine,
    EngineConfig,
    KVPolicy,
    SamplingParams,
    Session,
    SpeculativeConfig,
    TurnEndDecision,
)

SYSTEM = (
    "You are a careful assistant for a team of software engineers. Answer in one short "
    "sentence. Prefer plain words. If a question is about code, name the file or function "
    "involved. Never invent facts; say you do not know instead. Keep units and numbers exact."
)
QUESTIONS = [
    ["What is a hash map?", "And a linked list?"],
    ["What does git rebase do?", "Is it safe on shared branches?"],
    ["What is a mutex?", "When do I need one?"],
    ["What is a unit test?", "How small should it be?"],
]
BLOCK_SIZE = 16


class KeepSystemPrompt(KVPolicy):
    """Soft-pin the first ``num_pinned_tokens`` of every turn (the shared system prompt);
    under pressure release the held KV with the most blocks x turns idle first."""

    name = "keep-system-prompt"

    def __init__(self, num_pinned_tokens: int) -> None:
        self.num_pinned_tokens = num_pinned_tokens
        self.num_pins = 0
        self.released: list[tuple[str, int, int]] = []  # (handle, blocks, turns idle)

    def on_turn_end(self, turn):
        num_blocks = min(self.num_pinned_tokens // turn.block_size, turn.num_full_blocks)
        self.num_pins += num_blocks > 0
        return TurnEndDecision(soft_pin_blocks=num_blocks)

    def choose_evictions(self, candidates, num_blocks):
        now = max(c.last_used for c in candidates) + 1

        def cost(c):
            return c.num_blocks * (now - c.last_used)

        order = sorted(candidates, key=cost, reverse=True)
        self.released += [(c.handle, c.num_blocks, now - c.last_used) for c in order[:1]]
        return [c.handle for c in order]


class Broken(KVPolicy):
    """Answers outside every contract: the engine refuses it and uses the built-in decision."""

    name = "broken"

    def on_turn_end(self, turn):
        return TurnEndDecision(soft_pin_blocks=10_000)  # more blocks than the turn has

    def choose_evictions(self, candidates, num_blocks):
        return ["no-such-handle"]


async def run(engine: Engine, policy: KVPolicy) -> None:
    sampling = SamplingParams(max_tokens=12)
    sessions = [Session(engine, system=SYSTEM, sampling=sampling) for _ in QUESTIONS]
    for turn in range(2):  # round-robin: every session's held KV competes for the pool
        for i, session in enumerate(sessions):
            reply = await session.send(QUESTIONS[i][turn])
            u = reply.usage
            print(
                f"session {i} turn {turn + 1}: prompt {u.prompt_tokens:3d} | cached "
                f"{u.cached_tokens:3d} | computed {u.computed_tokens:3d} | "
                f"{reply.content.strip()[:50]!r}"
            )
    for session in sessions:
        await session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broken", action="store_true", help="a policy that answers nonsense")
    parser.add_argument("--num-blocks", type=int, default=20, help="KV pool size, in blocks")
    args = parser.parse_args()
    # the chat template renders the system prompt into ~60 tokens: 3 full blocks everyone shares
    policy = Broken() if args.broken else KeepSystemPrompt(num_pinned_tokens=3 * BLOCK_SIZE)
    config = EngineConfig(
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=args.num_blocks, kv_policy=policy),
        speculative=SpeculativeConfig(enabled=False),
    )
    with Engine(config) as engine:
        anyio.run(run, engine, policy)
        stats = engine.stats()
        engine.check_integrity()
    print(f"policy {policy.name!r}: kv_policy_errors={stats.kv_policy_errors}")
    if isinstance(policy, KeepSystemPrompt):
        print(f"turns that soft-pinned the system prompt: {policy.num_pins}")
        for handle, blocks, idle in policy.released:
            print(f"released first: {blocks} blocks idle {idle} turns ({handle[:8]}...)")
    print(
        f"prefix cache: {stats.num_cached_tokens}/{stats.prefix_cache_query_tokens} "
        f"prompt tokens reused; cache integrity ok"
    )


if __name__ == "__main__":
    main()
