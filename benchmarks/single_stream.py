"""Single-stream probe, every engine side by side in one run: 2K prefill and decode speed.

Each engine runs as a worker subprocess (``agentx bench``'s adapters: agentx's own worker and
the peers in ``benchmarks/peers``), one request at a time, greedy, EOS ignored:

    prefill   time to first token of a fresh 2,048-token prompt (median of 3 after a warm-up)
    decode    output tokens/s from the first token to the last: 128 tokens after a short
              (128-token) prompt and after a 2,048-token prompt

With ``--sweep`` every engine is first measured at each thread count x OpenMP wait policy
(``--omp-wait`` of the workers) on a short probe, and the full probe then runs with each
engine's best setting; the sweep is printed with the results. Peers need their venvs
(``benchmarks/peers/setup_*.sh``).

    python benchmarks/single_stream.py --engines agentx,agentx-fp32,llamacpp,vllm --sweep

With ``--paired N`` the engines are then loaded all at once (each at its setting) and given N
rounds of 2K prefills, one fresh prompt a round to each engine in turn: a shared host's drift
(20% or more between minutes) moves each round's engines together, so each round's TTFT over
the first engine's is a ratio measured under one host state (median, min and max printed).

``agentx`` is the default configuration (the GGUF's own quantized weights, fused layers),
``agentx-fp32`` is ``quantization="none"`` (every weight dequantized to fp32).
"""

# ruff: noqa: E402 - OMP_WAIT_POLICY must be set before torch is imported

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import datetime
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from agentx.bench.adapter import Done, GenerateRequest
from agentx.bench.engines import EngineSettings, make_engine, resolve_model
from agentx.bench.results import machine_info

PROMPT_LONG = 2048
PROMPT_SHORT = 128
DECODE_TOKENS = 128
FIRST_PLAIN_TOKEN_ID = 100
VOCAB = 49152


@dataclass(frozen=True, slots=True)
class Setting:
    threads: int
    omp_wait: str

    def label(self) -> str:
        return f"{self.threads} thr, {self.omp_wait}"


def _prompt(seed: str, size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_PLAIN_TOKEN_ID, VOCAB) for _ in range(size)]


async def _one(adapter, rid: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Timestamps of every output token (receipt times), the submit time first."""
    times = [time.perf_counter()]
    request = GenerateRequest(rid, rid, prompt, max_tokens)
    async for event in adapter.generate(request):
        if isinstance(event, Done):
            break
        times.extend([time.perf_counter()] * event.n)
    await adapter.end_session(rid)
    return times


def _decode_rate(times: list[float]) -> float:
    return (len(times) - 2) / (times[-1] - times[1])


# agentx with every weight dequantized to fp32, through its own worker
ALIASES = {"agentx-fp32": f"agentx={sys.executable} -m agentx.bench.worker --quantization none"}


async def _start(spec: str, settings: EngineSettings, omp_wait: str):
    """An engine's worker, started with the wait policy; returns (adapter, its info)."""
    spec = ALIASES.get(spec, spec)
    name = spec.split("=", 1)[0]
    command = spec if "=" in spec else None
    adapter = make_engine(command or name, settings)()
    if name.startswith("agentx"):  # agentx's workers take the policy from the environment
        os.environ.pop("GOMP_SPINCOUNT", None)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE" if omp_wait == "passive" else "ACTIVE"
        if omp_wait == "spin":
            os.environ.pop("OMP_WAIT_POLICY")
            os.environ["GOMP_SPINCOUNT"] = "10000"
    else:
        adapter.command += ["--omp-wait", omp_wait]
    return adapter, await adapter.start()


async def _probe(spec: str, settings: EngineSettings, omp_wait: str, full: bool) -> dict:
    adapter, info = await _start(spec, settings, omp_wait)
    try:
        await _one(adapter, "warm", _prompt("warm", 64), 8)
        short = await _one(adapter, "short", _prompt("short", PROMPT_SHORT), DECODE_TOKENS)
        result = {"engine": info.engine, "version": info.version,
                  "decode_short_tok_s": _decode_rate(short)}  # fmt: skip
        if full:
            ttfts = []
            for i in range(4):
                times = await _one(adapter, f"prefill{i}", _prompt(f"prefill{i}", PROMPT_LONG), 1)
                if i:
                    ttfts.append(times[1] - times[0])
            long = await _one(adapter, "long", _prompt("long", PROMPT_LONG), DECODE_TOKENS)
            result |= {
                "prefill_2k_ttft_s": statistics.median(ttfts),
                "prefill_2k_tok_s": PROMPT_LONG / statistics.median(ttfts),
                "decode_after_2k_tok_s": _decode_rate(long),
            }
        return result
    finally:
        await adapter.close()


def _settings(model: str, threads: int, default_model: bool = True) -> EngineSettings:
    # with --model, every engine loads that file (peers included), not their converted copies
    return EngineSettings(
        model=model, threads=threads, kv_cache_gib=0.5, default_model=default_model
    )


async def main_async(args: argparse.Namespace) -> dict:
    model = resolve_model(args.model)
    default_model = args.model in (None, "", "default")
    engines = args.engines.split(",")
    grid = [Setting(t, w) for t in args.threads for w in args.omp_wait]
    settings: dict[str, Setting] = {}
    record = {"command": " ".join(["python", *sys.argv]), "machine": _machine(),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "sweep": {}, "results": {}}  # fmt: skip
    for spec in engines:
        best = grid[0]
        if args.sweep and len(grid) > 1:
            rates = {}
            for setting in grid:
                probe = await _probe(
                    spec, _settings(model, setting.threads, default_model), setting.omp_wait, False
                )
                rates[setting.label()] = probe["decode_short_tok_s"]
                print(f"  sweep {spec} {setting.label()}: {rates[setting.label()]:.1f} tok/s",
                      file=sys.stderr, flush=True)  # fmt: skip
            best = grid[[s.label() for s in grid].index(max(rates, key=rates.get))]
            record["sweep"][spec] = rates
        result = await _probe(
            spec, _settings(model, best.threads, default_model), best.omp_wait, True
        )
        result["setting"] = best.label()
        record["results"][spec] = result
        print(f"{spec}: {result}", file=sys.stderr, flush=True)
        settings[spec] = best
    if args.paired:
        record["paired"] = await _paired(engines, settings, model, default_model, args.paired)
    return record


async def _paired(
    engines: list[str], settings: dict, model, default_model: bool, rounds: int
) -> dict:
    """2K prefills with every engine loaded at once, one fresh prompt a round for each in turn.

    On a shared host an engine's prefill moves by 20% or more between minutes; probes one
    engine after another then put the host's drift into their ratio. Here each round gives
    every engine the same prompt back to back (the order rotating round by round, so that no
    engine always goes first), and each round's TTFTs make one ratio to the first engine's.
    """
    started = []
    try:
        for spec in engines:
            best = settings[spec]
            adapter, _ = await _start(spec, _settings(model, best.threads, default_model),
                                      best.omp_wait)  # fmt: skip
            started.append(adapter)
            await _one(adapter, "warm", _prompt("warm", 64), 8)
            await _one(adapter, "warm-2k", _prompt("paired-warm", PROMPT_LONG), 1)
        ttfts: dict[str, list[float]] = {spec: [] for spec in engines}
        for i in range(rounds):
            prompt = _prompt(f"paired{i}", PROMPT_LONG)
            for j in range(len(engines)):
                k = (i + j) % len(engines)
                times = await _one(started[k], f"paired{i}", prompt, 1)
                ttfts[engines[k]].append(times[1] - times[0])
            print(f"  paired round {i}: " + ", ".join(f"{ttfts[s][-1]:.3f} s" for s in engines),
                  file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for adapter in started:
            await adapter.close()
    first = ttfts[engines[0]]
    out = {"rounds": rounds, "ttft_s": ttfts, "median_ttft_s": {}, "ratio_to": engines[0],
           "ratio": {}}  # fmt: skip
    for spec in engines:
        out["median_ttft_s"][spec] = statistics.median(ttfts[spec])
        ratios = [mine / theirs for mine, theirs in zip(ttfts[spec], first, strict=True)]
        out["ratio"][spec] = {"median": statistics.median(ratios), "min": min(ratios),
                              "max": max(ratios)}  # fmt: skip
    return out


def _machine() -> dict:
    return {"cpu": machine_info()["cpu"], "cores": os.cpu_count(),
            "python": platform.python_version()}  # fmt: skip


def render(record: dict) -> str:
    m = record["machine"]
    lines = [f"`{record['command']}` ({record['date']}, {m['cpu']}, {m['cores']} cores)", "",
             "| engine | setting | prefill 2K tok/s (TTFT s) | decode tok/s, 128-token prompt "
             "| decode tok/s, after 2K |", "|---|---|---|---|---|"]  # fmt: skip
    for spec, r in record["results"].items():
        lines.append(
            f"| {spec} | {r['setting']} | {r['prefill_2k_tok_s']:.0f} "
            f"({r['prefill_2k_ttft_s']:.2f}) | {r['decode_short_tok_s']:.1f} "
            f"| {r['decode_after_2k_tok_s']:.1f} |"
        )
    for spec, rates in record["sweep"].items():
        sweep = ", ".join(f"{k}: {v:.1f}" for k, v in rates.items())
        lines.append(f"\nsweep {spec} (decode tok/s, 128-token prompt): {sweep}")
    paired = record.get("paired")
    if paired:
        lines += ["", f"Paired 2K prefills ({paired['rounds']} rounds, every engine loaded, "
                  f"each round's prompt to each in turn): TTFT, and each round's TTFT over "
                  f"{paired['ratio_to']}'s", "",
                  "| engine | median TTFT s (tok/s) | TTFT / first engine's: median (min - max) |",
                  "|---|---|---|"]  # fmt: skip
        for spec, median in paired["median_ttft_s"].items():
            r = paired["ratio"][spec]
            lines.append(f"| {spec} | {median:.2f} ({PROMPT_LONG / median:.0f}) | "
                         f"{r['median']:.2f} ({r['min']:.2f} - {r['max']:.2f}) |")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="agentx,agentx-fp32,llamacpp,vllm")
    parser.add_argument("--model", default=None, help="agentx's model (default: the embedded)")
    parser.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[2])
    parser.add_argument(
        "--omp-wait", type=lambda s: s.split(","), default=["passive"],
        help="comma-separated OpenMP wait policies for the sweep (passive, spin, active)",
    )  # fmt: skip
    parser.add_argument("--sweep", action="store_true", help="pick each engine's best setting")
    parser.add_argument(
        "--paired", type=int, default=0, metavar="N",
        help="then N rounds of 2K prefills with every engine loaded at once, alternated",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.paired < 0:
        parser.error(f"--paired takes a number of rounds >= 0, got {args.paired}")
    return args


def main() -> int:
    args = parse_args()
    record = asyncio.run(main_async(args))
    print(render(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
