"""Recomputed tokens with and without BranchPoint / TurnsLeft, replayed on the KV manager under
memory pressure (no model: what a turn recomputes is what its prompt's earlier tokens miss in
held KV and the prefix cache, so the KV policy alone decides it). Deterministic; < 5 s on CPU.

    PYTHONPATH=. python benchmarks/kv_hints_pressure.py

fan-out   12 parents (512-token context) each fork 4 subagents; every subagent's first turn
          waits behind background turns (16 sessions, +128 tokens a turn) that fill the pool.
turns     24 sessions of 2..10 turns (+96 tokens a turn), round robin; a session that had its
          last turn is closed only 12 turns later (the harness collects it), so its held KV
          competes with live sessions'.
"""

from __future__ import annotations

import itertools
import random

import torch

from agentx.engine.hints import BranchPoint, TurnsLeft
from agentx.engine.kv_cache import FullAttentionSpec, KVCacheGroup, KVCacheLayout, KVCacheManager
from agentx.engine.request import Request, RequestStatus
from agentx.engine.sampling import SamplingParams

BLOCK = 16
_ids = itertools.count()
_fresh = itertools.count(1000)


def new_tokens(n: int) -> list[int]:
    return [next(_fresh) for _ in range(n)]


class Replay:
    def __init__(self, num_blocks: int) -> None:
        spec = FullAttentionSpec(BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
        self.kv = KVCacheManager(KVCacheLayout(num_blocks, (KVCacheGroup(spec, (0,)),)))
        self.recomputed = 0
        self._seen: dict[str, int] = {}  # handle -> tokens its session had computed

    def turn(self, tokens: list[int], handle: str | None, hints=()) -> str:
        """Run one turn whose prompt is ``tokens`` (``handle``: the held KV it continues; its
        tokens were computed before); returns the new handle. Counts recomputed tokens."""
        rid = f"r{next(_ids)}"
        held = self.kv.get_held(handle)
        seen = held.num_tokens if held is not None else self._seen.get(handle, 0)
        r = Request(rid, list(tokens), SamplingParams(max_tokens=1), block_size=BLOCK,
                    hold_kv=True, held_kv=handle, hints=tuple(hints))  # fmt: skip
        hit, n = self.kv.get_computed_blocks(r)
        assert self.kv.allocate_slots(r, len(tokens) - n, n, hit) is not None, "pool too small"
        self.recomputed += max(0, seen - n)
        r.num_computed_tokens = len(tokens)
        r.append_output_token(1)
        r.status = RequestStatus.FINISHED_STOPPED
        self.kv.finish_turn(r, hold=True)
        self._seen[rid] = len(tokens)
        return rid

    def fork(self, handle: str, n: int) -> list[str]:
        new = [f"{handle}/f{i}" for i in range(n)]
        if self.kv.fork_held(handle, new) is None:
            return [handle] * n  # no room: the forks run from the prefix cache
        for h in new:
            self._seen[h] = self.kv.get_held(h).num_tokens
        return new


def fan_out(hinted: bool) -> tuple[int, int]:
    """Recomputed tokens: all, and the subagents' shared context alone."""
    rng = random.Random(0)
    replay = Replay(num_blocks=400)
    background = [(new_tokens(256), None) for _ in range(16)]
    shared = 0
    for _ in range(12):
        context = new_tokens(512)
        hints = (BranchPoint(4),) if hinted else ()
        parent = replay.turn(context, None, hints)
        forks = replay.fork(parent, 4)
        replay.kv.release_held(parent)  # the parent waits on its subagents: nothing to extend
        for f in forks:
            for _ in range(rng.randint(1, 3)):  # other sessions' turns before this subagent
                i = rng.randrange(len(background))
                tokens, handle = background[i]
                tokens = tokens + new_tokens(128)
                if len(tokens) > 1500:
                    tokens, handle = new_tokens(256), None
                background[i] = (tokens, replay.turn(tokens, handle))
            before = replay.recomputed
            child = replay.turn(context + new_tokens(64), f)
            shared += replay.recomputed - before
            replay.kv.release_held(child)
        replay.kv.check_integrity()
    return replay.recomputed, shared


def turns(hinted: bool) -> tuple[int, int]:
    """Recomputed tokens: all, and by the sessions' own next turns (the same here)."""
    rng = random.Random(1)
    replay = Replay(num_blocks=260)
    sessions = []
    for _ in range(24):
        sessions.append({"tokens": new_tokens(160), "handle": None, "left": rng.randint(2, 10)})
    closing: list[tuple[int, str]] = []  # (step to close at, handle)
    step = 0
    while any(s["left"] > 0 for s in sessions):
        for s in sessions:
            if s["left"] == 0:
                continue
            step += 1
            s["left"] -= 1
            s["tokens"] = s["tokens"] + new_tokens(96)
            hints = (TurnsLeft(s["left"]),) if hinted else ()
            s["handle"] = replay.turn(s["tokens"], s["handle"], hints)
            if s["left"] == 0:
                closing.append((step + 12, s["handle"]))
            for at, handle in [c for c in closing if c[0] <= step]:
                replay.kv.release_held(handle)
                closing.remove((at, handle))
    replay.kv.check_integrity()
    return replay.recomputed, replay.recomputed


if __name__ == "__main__":
    for name, run in (("fan-out (BranchPoint)", fan_out), ("turns (TurnsLeft)", turns)):
        (without, part_without), (with_hint, part_with) = run(False), run(True)
        line = f"{name:22s} recomputed tokens: without {without:6d}  with {with_hint:6d}"
        if run is fan_out:
            line += f"  (the subagents' shared context: {part_without} -> {part_with})"
        print(line)
