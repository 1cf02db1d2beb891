"""``agentx bench`` / ``python -m agentx.bench``: synth, run, compare, saturate, plot.

    agentx bench synth -o trace.jsonl [--sessions 8 --scale 0.05 --output-scale 0.25
                                       --max-context 7680 --seed 0]
    agentx bench run [TRACE] [--engine agentx-inproc] [--concurrency 2,8] [--out DIR]
                             [--prompts text|random] [--loop auto|open|closed]
    agentx bench compare [TRACE] --engines agentx,vllm [--concurrency 2,8] [--out DIR]
    agentx bench saturate TRACE --out DIR [--engines agentx] [--batches 1,4,16]
    agentx bench plot DIR/results.json [--out DIR]

Without TRACE, ``run`` and ``compare`` synthesize the default scaled trace. Prompts are real
text by default (``--prompts text``: code, tool output and prose from the committed corpus, each
engine tokenizing it with its own tokenizer) or random token ids (``--prompts random``). With
``--loop auto`` a synthesized trace (in memory, or a file ``synth`` wrote) replays closed loop in
text mode (each turn's prompt carries what the engine generated) and a recorded trace open loop
(:mod:`agentx.bench.closed_loop`).
Results go to ``DIR/results.json`` (rewritten after every point), ``DIR/results.md`` and
``DIR/*.png``; ``saturate``'s to ``DIR/saturation.json`` (:mod:`agentx.bench.saturate`), ``.md``
and ``.png``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path

from agentx.bench.engines import PARALLEL_DEGREES
from agentx.bench.trace import Trace

DEFAULT_SCALE = 0.05
DEFAULT_OUTPUT_SCALE = 0.25  # a median of ~110 output tokens a turn: decode that weighs
MODEL_CONTEXT = 8192  # SmolLM2's
# synthesized traces stop 512 tokens short of it: a text prompt tokenizes to its trace length
# within a few % (agentx/bench/corpus.py), and must still fit
DEFAULT_MAX_CONTEXT = MODEL_CONTEXT - 512


def _add_synth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=8, help="session trees (default 8)")
    p.add_argument("--seed", type=int, default=0, help="synthesis seed (default 0)")
    p.add_argument(
        "--scale",
        type=float,
        default=DEFAULT_SCALE,
        help="token counts x SCALE, turns x sqrt(SCALE); 1 = published sizes "
        f"(default {DEFAULT_SCALE}: fits SmolLM2's 8K context on a CPU)",
    )
    p.add_argument(
        "--output-scale",
        type=float,
        default=DEFAULT_OUTPUT_SCALE,
        help=f"output lengths x OUTPUT_SCALE (default {DEFAULT_OUTPUT_SCALE}: a median of ~110 "
        "tokens a turn; 1 = published)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=DEFAULT_MAX_CONTEXT,
        help="an agent compacts (or stops) before a turn that would not fit (default "
        f"{DEFAULT_MAX_CONTEXT}: SmolLM2's 8K less room for text tokenization)",
    )
    p.add_argument(
        "--block-size", type=int, default=64, help="tokens per trace hash id (default 64)"
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", help="trace file (.json/.jsonl); default: synthesize one")
    _add_synth_args(p)
    p.add_argument("--concurrency", default="8", help="comma-separated sweep, e.g. 2,8")
    p.add_argument("--max-think", type=float, default=5.0, help="cap on think time, seconds")
    p.add_argument(
        "--prompts",
        choices=("text", "random"),
        default="text",
        help="prompt content: corpus text each engine tokenizes (default) or random token ids",
    )
    p.add_argument(
        "--loop",
        choices=("auto", "open", "closed"),
        default="auto",
        help="closed: a turn's prompt carries the engine's earlier output; auto (default): "
        "closed for a synthesized trace with text prompts, else open",
    )
    _add_engine_args(p)
    p.add_argument(
        "--floor",
        type=float,
        default=5.0,
        help="interactivity floor for TPGS-at-floor, tokens/s (default 5)",
    )
    p.add_argument("--out", default="bench-results", help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="write no .png plots")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default SmolLM2-135M)")
    p.add_argument(
        "--peer-model",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a peer engine's own model file (repeatable)",
    )
    p.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="CPU threads (default: all cores)"
    )
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache size (default 2)")
    p.add_argument("--dtype", default="float32", help="activation dtype (default float32)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="agentx's token budget per step, i.e. its prefill chunk (default 2048)",
    )
    for degree in PARALLEL_DEGREES:
        p.add_argument(
            f"--{degree}", type=int, default=1, help=f"agentx's ParallelConfig.{degree} (default 1)"
        )


def _numbers(kind: type, low: float, high: float | None = None):
    """An argparse type: comma-separated ``kind`` values in ``[low, high]``."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a list of {kind.__name__}: {text!r}") from None
        bad = [v for v in values if v < low or (high is not None and v > high)]
        if not values or bad:
            span = f"[{low:g}, {high:g}]" if high is not None else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"values must be {span}, got {text!r}")
        return values

    return parse


def _add_saturate_args(p: argparse.ArgumentParser) -> None:
    from agentx.bench.saturate import SaturateConfig

    d = SaturateConfig()
    p.add_argument("trace", help="trace file (.json/.jsonl): its lengths choose the buckets")
    p.add_argument("--out", required=True, help="folder for saturation.json / .md / .png")
    p.add_argument("--engines", default="agentx", help="comma-separated engine specs")
    _add_engine_args(p)
    floats01, ints = _numbers(float, 0.0, 1.0), _numbers(int, 1)
    p.add_argument("--quantiles", type=floats01, default=d.quantiles, help="default 0.1,0.5,0.9")
    p.add_argument("--prompt-lengths", type=ints, default=None, help="instead of the trace's")
    p.add_argument("--cached-fractions", type=floats01, default=None, help="instead of the trace's")
    p.add_argument("--contexts", type=ints, default=None, help="decode contexts instead")
    p.add_argument("--batches", type=ints, default=d.batches, help="decode batches (1,4,16)")
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=d.decode_tokens,
        help=f"tokens per decode probe (default {d.decode_tokens})",
    )
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=d.prefill_tokens,
        help=f"uncached tokens per prefill probe (default {d.prefill_tokens})",
    )
    p.add_argument(
        "--max-requests",
        type=int,
        default=d.max_requests,
        help=f"requests per probe at most (default {d.max_requests})",
    )
    p.add_argument(
        "--interactivity-floor",
        type=float,
        default=d.interactivity_floor,
        help=f"per-request output tokens/s floor (default {d.interactivity_floor:g})",
    )
    p.add_argument("--max-context", type=int, default=MODEL_CONTEXT, help="the model's context")
    p.add_argument(
        "--distinct-contexts",
        action="store_true",
        help="decode probes: a context of its own per request (default: shared but the last block)",
    )
    p.add_argument("--no-plots", action="store_true", help="write no .png plot")


def _plain(doc: str) -> str:
    """A docstring for a terminal: reStructuredText's ``literals`` and :role:`x` unmarked."""
    return re.sub(r":\w+:`([^`]+)`", r"\1", doc).replace("``", "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentx bench",
        description=_plain(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("synth", help="write a synthetic AgentX trace")
    s.add_argument("-o", "--output", required=True, help="trace file (.jsonl or .json)")
    _add_synth_args(s)
    r = sub.add_parser("run", help="replay a trace on one engine, sweeping concurrency")
    _add_run_args(r)
    r.add_argument("--engine", default="agentx-inproc", help="engine spec (see engines.py)")
    c = sub.add_parser("compare", help="replay a trace on several engines")
    _add_run_args(c)
    c.add_argument("--engines", default="agentx", help="comma-separated engine specs")
    sat = sub.add_parser("saturate", help="prefill-only and decode-only max tokens/s per engine")
    _add_saturate_args(sat)
    pl = sub.add_parser("plot", help="re-render plots and the Markdown table from results")
    pl.add_argument("results", help="results.json")
    pl.add_argument("--out", default=None, help="folder (default: next to the results)")
    pl.add_argument(
        "--floor", type=float, default=None, help="interactivity floor (default: the results')"
    )
    return p


def synth_trace(args: argparse.Namespace) -> Trace:
    from agentx.bench.synth import SynthConfig, synthesize

    return synthesize(
        SynthConfig(
            num_sessions=args.sessions,
            seed=args.seed,
            scale=args.scale,
            output_scale=args.output_scale,
            max_context_tokens=args.max_context,
            block_size=args.block_size,
        )
    )


def print_stats(trace: Trace) -> dict:
    from agentx.bench.trace_stats import trace_stats

    stats = trace_stats(trace).to_dict()
    print(
        f"{trace.trace_id}: {stats['num_sessions']} sessions, {stats['num_requests']} requests, "
        f"median {stats['median_turns']:g} turns, median input {stats['median_input_tokens']:g}"
        f" tokens, median output {stats['median_output_tokens']:g} tokens, max input "
        f"{stats['max_input_tokens']} tokens, "
        f"{stats['subagent_session_fraction']:.0%} of sessions spawn subagents "
        f"(median {stats['median_subagents']:g})\n"
        f"theoretical prefix hit rate {stats['theoretical_hit_rate']:.2%} "
        f"({stats['theoretical_hit_tokens']} of {stats['num_prompt_tokens']} prompt tokens in "
        f"{trace.block_size}-token blocks seen before in the trace)",
        file=sys.stderr,
    )
    return stats


def cmd_synth(args: argparse.Namespace) -> int:
    from agentx.bench.format_agentx import dump_agentx

    trace = synth_trace(args)
    dump_agentx(trace, args.output)
    print_stats(trace)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def make_engines(args: argparse.Namespace, specs: list[str]):
    """(name -> adapter factory, the shared EngineSettings, the prompts' TokenSpace)."""
    from agentx.bench import engines as eng
    from agentx.bench.prompts import TokenSpace

    needs_model = any(eng.engine_name(s) != "fake" for s in specs)
    model = eng.resolve_model(args.model) if needs_model else (args.model or "")
    peer_models = dict(item.split("=", 1) for item in args.peer_model)
    settings = eng.EngineSettings(
        model,
        args.threads,
        args.kv_cache_gib,
        args.dtype,
        args.max_num_batched_tokens,
        peer_models,
        args.model is None,
        {d: getattr(args, d) for d in PARALLEL_DEGREES if getattr(args, d) != 1},
    )
    factories = {eng.engine_name(s): eng.make_engine(s, settings) for s in specs}
    space = eng.token_space_for_model(model) if needs_model else TokenSpace.default()
    return factories, settings, space


def cmd_run(args: argparse.Namespace, specs: list[str]) -> int:
    from agentx.bench.loader import load_trace
    from agentx.bench.prompts import make_prompt_source
    from agentx.bench.results import Results, make_header
    from agentx.bench.sweep import run_sweep
    from agentx.bench.trace_stats import think_bound

    trace = load_trace(args.trace) if args.trace else synth_trace(args)
    stats = print_stats(trace)
    factories, settings, space = make_engines(args, specs)
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    loop = replay_loop(args.loop, args.prompts, synthesized="synth" in trace.meta)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "engines": specs,
        "concurrency": concurrencies,
        "max_think": args.max_think,
        "settings": asdict(settings),
        "floor": args.floor,
        "reference": specs[0],
        "token_space": {"low": space.low, "high": space.high},
        "prompts": args.prompts,
        "loop": loop,
    }
    trace_info = {
        "id": trace.trace_id,
        "path": args.trace,
        "format": trace.source_format,
        "block_size": trace.block_size,
        "stats": stats,
        "meta": trace.meta,
        # the wall time of an engine that takes no time: think times alone (TPGS's ceiling)
        "think_bound_s": {str(c): think_bound(trace, c, args.max_think) for c in concurrencies},
    }
    header = make_header(trace_info, config)
    runs = []

    def save(result) -> None:
        runs.append(result)
        Results(header, tuple(runs)).write(out / "results.json", args.floor)

    run_sweep(
        trace,
        factories,
        concurrencies,
        make_prompt_source(args.prompts, trace.block_size, space),
        args.max_think,
        not args.no_progress,
        save,
        loop,
    )
    return _render(Results(header, tuple(runs)), out, args.floor, not args.no_plots)


def replay_loop(loop: str, prompts: str, synthesized: bool) -> str:
    """``--loop auto``: closed for a synthesized trace in text mode (a real agent's prompts
    carry its model's output), open for a recorded trace or random ids."""
    if loop != "auto":
        return loop
    return "closed" if synthesized and prompts == "text" else "open"


def _render(results, out: Path, floor: float, plots: bool) -> int:
    from agentx.bench.report import markdown

    text = markdown(results, floor)
    (out / "results.md").write_text(text)
    print(text)
    if plots:
        from agentx.bench.plots import plot_all

        for path in plot_all(results, out):
            print(f"wrote {path}", file=sys.stderr)
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}", file=sys.stderr)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from agentx.bench.results import Results

    results = Results.read(args.results)
    out = Path(args.out) if args.out else Path(args.results).parent
    out.mkdir(parents=True, exist_ok=True)
    floor = args.floor if args.floor is not None else results.header["config"].get("floor", 5.0)
    return _render(results, out, floor, True)


def _log(name: str, line: str) -> None:
    print(f"[saturate] {name}: {line}", file=sys.stderr)


def cmd_saturate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import asyncio
    from dataclasses import replace
    from functools import partial

    from agentx.bench.loader import load_trace
    from agentx.bench.prompts import PromptBuilder
    from agentx.bench.saturate import SaturateConfig, derive_buckets, profile_engine, profile_json
    from agentx.bench.saturate_report import write_profile
    from agentx.errors import ConfigError

    try:
        config = SaturateConfig(
            quantiles=args.quantiles,
            batches=args.batches,
            decode_tokens=args.decode_tokens,
            prefill_tokens=args.prefill_tokens,
            max_requests=args.max_requests,
            interactivity_floor=args.interactivity_floor,
            max_context=args.max_context,
            distinct_contexts=args.distinct_contexts,
        )
    except ConfigError as exc:
        parser.error(str(exc))
    trace = load_trace(args.trace)
    buckets = derive_buckets(trace, config)
    overrides = {"prompt_tokens": args.prompt_lengths, "context_tokens": args.contexts}
    overrides["cached_fractions"] = args.cached_fractions
    buckets = replace(buckets, **{k: tuple(sorted(v)) for k, v in overrides.items() if v})
    print(f"buckets: {buckets}", file=sys.stderr)
    specs = [s.strip() for s in args.engines.split(",") if s.strip()]
    factories, settings, space = make_engines(args, specs)
    prompts = PromptBuilder(trace.block_size, space)
    trace_info = {"id": trace.trace_id, "path": args.trace, "block_size": trace.block_size,
                  "num_requests": trace.num_requests}  # fmt: skip
    profiles = {}
    for name, factory in factories.items():
        log = partial(_log, name)
        profiles[name] = asyncio.run(profile_engine(factory, buckets, prompts, config, log))
    profile = profile_json(trace_info, config, buckets, profiles)
    profile["settings"] = asdict(settings)
    for path in write_profile(profile, Path(args.out), plots=not args.no_plots):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def bench_main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "saturate":
        return cmd_saturate(args, parser)
    if args.command == "synth":
        return cmd_synth(args)
    if args.command == "run":
        return cmd_run(args, [args.engine])
    if args.command == "compare":
        return cmd_run(args, [s.strip() for s in args.engines.split(",") if s.strip()])
    return cmd_plot(args)


def main(argv: list[str] | None = None) -> int:
    """The ``agentx`` console script: ``agentx bench ...``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "bench":
        print("usage: agentx bench {synth,run,compare,saturate,plot} ...", file=sys.stderr)
        return 2
    return bench_main(argv[1:])
