"""A saturation profile (:func:`agentx.bench.saturate.profile_json`) as files: the JSON itself,
a Markdown table per engine and a plot."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(profile: dict) -> str:
    config, trace = profile["config"], profile["trace"]
    floor = config["interactivity_floor"]
    lines = [
        f"# agentx bench saturate: {trace['id']}",
        "",
        f"Buckets from the trace's quantiles {config['quantiles']}: "
        f"{json.dumps(profile['buckets'])}",
    ]
    for name, part in profile["engines"].items():
        lines += [
            "",
            f"## {name}",
            "",
            "Prefill-only (one output token per request):",
            "",
            "| prompt tokens | cached bucket | cached tokens | requests | computed tok/s | "
            "prompt tok/s | TTFT P50 s |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in part["prefill"]:
            lines.append(
                f"| {p['prompt_tokens']} | {p['cached_fraction']:.0%} | {p['cached_tokens']} "
                f"({p['cached_tokens'] / p['prompt_tokens']:.0%}) | "
                f"{p['num_requests']} | {p['computed_tokens_per_s']:,.0f} | "
                f"{p['prompt_tokens_per_s']:,.0f} | {_fmt(p['ttft_p50'], '.2f')} |"
            )
        lines += [
            "",
            f"Decode-only ({config['decode_tokens']} output tokens per request):",
            "",
            "| context tokens | batch | tok/s | interactivity P50 / P90 tok/s |",
            "|---|---|---|---|",
        ]
        for d in part["decode"]:
            lines.append(
                f"| {d['context_tokens']} | {d['batch']} | {d['tokens_per_s']:,.1f} | "
                f"{_fmt(d['interactivity_p50'], '.2f')} / {_fmt(d['interactivity_p90'], '.2f')} |"
            )
        lines += ["", f"Decode max tok/s at interactivity P90 >= {floor:g} tok/s:", ""]
        lines += ["| context tokens | batch | tok/s |", "|---|---|---|"]
        for a in part["decode_at_floor"]:
            lines.append(
                f"| {a['context_tokens']} | {_fmt(a['batch'], 'd')} | "
                f"{_fmt(a['tokens_per_s'], ',.1f')} |"
            )
    return "\n".join(lines) + "\n"


def write_profile(profile: dict, out: Path, plots: bool = True) -> list[Path]:
    """``saturation.json``, ``saturation.md`` and (with ``plots``) ``saturation.png`` in
    ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "saturation.json", out / "saturation.md"]
    paths[0].write_text(json.dumps(profile, indent=2) + "\n")
    paths[1].write_text(markdown(profile))
    if plots:
        from agentx.bench.plots import plot_saturation

        paths.append(plot_saturation(profile, out / "saturation.png"))
    return paths
