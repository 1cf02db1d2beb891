"""Two engine configurations' decode steps side by side, step after step in one process.

A shared host moves a step's time 15-30% between runs minutes apart (docs/bench/notes-2026-12-07h),
more than most changes it is asked to judge, so two configurations measured one process after the
other compare minutes as much as configurations. This builds both engines (``EngineCore``, no
engine thread), gives each the same ``--decoders`` prompts of ``--context`` random tokens, steps
both until every request decodes, then times ``--steps`` decode steps of each, A and B in turn
(each first every other time), so both see the same minutes. In A / A runs the engine built
second ran 2-4% faster on a Zen 4 VM with its pool on 4 KiB pages (an engine built and closed
before both did not change that; on huge pages neither ran faster), so each of ``--rounds``
builds a fresh pair, in the other order than the round before.

It prints each round's medians, each configuration's median step and quartiles over all rounds,
and B - A: in each round the median of the paired differences (step i of B against step i of A,
which cancels the drift between steps), averaged over the rounds (which cancels the build order).

    python benchmarks/step_ab.py --b cache.huge_pages=true
    python benchmarks/step_ab.py --b cache.block_size=64 --rounds 4
    python benchmarks/step_ab.py --a cache.kv_cache_dtype=bfloat16 --b cache.kv_cache_dtype=int8
    python benchmarks/step_ab.py                    # A / A: how far apart equal engines come out

Settings are ``field=value`` on ``EngineConfig`` (``quantization=int8``, ``small_step_tokens=64``)
or ``cache.field=value`` on its ``CacheConfig``; values read as true / false, integers, floats,
or else strings. Both engines take the defaults below (8 x 2K, 2 threads, a 1 GiB pool, 512-token
prefill chunks, no drafting) unless a setting says otherwise.
"""

# ruff: noqa: E402 - OMP_WAIT_POLICY must be set before torch is imported

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import gc
import random
import statistics
import time

from agentx import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from agentx.engine.core import EngineCore

VOCAB = 49152


def _value(raw: str) -> bool | int | float | str:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def config_with(base: EngineConfig, settings: list[str]) -> EngineConfig:
    """``base`` with each ``field=value`` / ``cache.field=value`` applied; a setting that names no
    field, or has no ``=``, raises ValueError."""
    top: dict = {}
    cache: dict = {}
    for setting in settings:
        name, sep, raw = setting.partition("=")
        if not sep:
            raise ValueError(f"{setting!r}: expected field=value")
        target, fields = (cache, CacheConfig) if name.startswith("cache.") else (top, EngineConfig)
        name = name.removeprefix("cache.")
        if name not in {f.name for f in dataclasses.fields(fields)}:
            raise ValueError(f"{setting!r}: {fields.__name__} has no field {name!r}")
        target[name] = _value(raw)
    if cache:
        top["cache"] = dataclasses.replace(base.cache, **cache)
    return dataclasses.replace(base, **top)


def _decoding(core: EngineCore, ids: list[str]) -> bool:
    running = {r.request_id for r in core.scheduler.running}
    return running >= set(ids) and all(
        r.num_computed_tokens >= r.num_prompt_tokens for r in core.scheduler.running
    )


def start(config: EngineConfig, prompts: list[list[int]], tag: str, steps: int) -> EngineCore:
    """An engine with every prompt prefilled and decoding, each request long enough to decode
    through the prefill of the others and then ``steps`` more steps."""
    core = EngineCore(config)
    # a step that prefills computes at least one prompt token: the prompts' tokens bound the
    # steps before every request decodes
    bound = sum(len(p) for p in prompts)
    sampling = SamplingParams(max_tokens=bound + steps + 8, ignore_eos=True)
    ids = []
    for i, prompt in enumerate(prompts):
        request = core.make_request(f"{tag}-{i}", prompt, sampling)
        core.add_request(request)
        ids.append(request.request_id)
    for _ in range(bound):
        if _decoding(core, ids):
            break
        core.step()
    else:
        core.close()
        raise RuntimeError(f"not every request decoding after {bound} steps")
    core.step()  # one decode step before the timed ones
    return core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", nargs="*", default=[], help="settings of configuration A")
    parser.add_argument("--b", nargs="*", default=[], help="settings of configuration B")
    parser.add_argument("--decoders", type=int, default=8, help="requests decoding")
    parser.add_argument("--context", type=int, default=2048, help="each prompt's tokens")
    parser.add_argument("--steps", type=int, default=100, help="timed steps of each, a round")
    parser.add_argument("--rounds", type=int, default=2, help="engine pairs: A-B, B-A, ...")
    parser.add_argument("--threads", type=int, default=2, help="EngineConfig.num_threads")
    parser.add_argument("--model", default=None, help="EngineConfig.model (default: embedded)")
    args = parser.parse_args()
    base = EngineConfig(
        **({} if args.model is None else {"model": args.model}),
        num_threads=args.threads,
        cache=CacheConfig(kv_cache_bytes=1 << 30),
        scheduler=SchedulerConfig(max_num_batched_tokens=512),
        speculative=SpeculativeConfig(enabled=False),
    )
    try:
        configs = {"A": config_with(base, args.a), "B": config_with(base, args.b)}
    except ValueError as error:
        parser.error(str(error))
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, VOCAB) for _ in range(args.context)] for _ in range(args.decoders)
    ]
    times: dict[str, list[float]] = {"A": [], "B": []}
    rounds = []
    for round_ in range(args.rounds):
        # the engine built second ran 2-4% faster in A / A runs (above): each round builds the
        # pair in the other order
        built = ("A", "B") if round_ % 2 == 0 else ("B", "A")
        cores = {tag: start(configs[tag], prompts, tag, args.steps) for tag in built}
        got: dict[str, list[float]] = {"A": [], "B": []}
        for i in range(args.steps):
            for tag in ("A", "B") if i % 2 == 0 else ("B", "A"):  # each first every other step
                begin = time.perf_counter()
                cores[tag].step()
                got[tag].append(time.perf_counter() - begin)
        for core in cores.values():
            core.close()
        del cores
        gc.collect()
        paired = statistics.median(b - a for a, b in zip(got["A"], got["B"], strict=True))
        rounds.append((built, statistics.median(got["A"]), statistics.median(got["B"]), paired))
        for tag, steps in got.items():
            times[tag] += steps
    print(
        f"{args.decoders} request(s) decoding at ~{args.context} tokens, {args.threads} threads, "
        f"{args.rounds} round(s) of {args.steps} steps each, A and B in turn"
    )
    for i, (built, a, b, paired) in enumerate(rounds, 1):
        print(
            f"round {i} (built {' then '.join(built)}): A {1e3 * a:.2f} ms, B {1e3 * b:.2f} ms, "
            f"B - A paired {1e3 * paired:+.2f} ms"
        )
    print("| config | settings | median ms | p25 | p75 |")
    print("|---|---|---|---|---|")
    for tag, steps in times.items():
        q = statistics.quantiles(steps, n=4)
        settings = " ".join(args.a if tag == "A" else args.b) or "(defaults)"
        print(
            f"| {tag} | {settings} | {1e3 * statistics.median(steps):.2f} | {1e3 * q[0]:.2f} | "
            f"{1e3 * q[2]:.2f} |"
        )
    mean = statistics.fmean(paired for *_, paired in rounds)
    print(
        f"B - A: {1e3 * mean:+.2f} ms a step ({mean / statistics.median(times['A']):+.1%}), "
        f"the rounds' paired medians averaged"
    )


if __name__ == "__main__":
    main()
