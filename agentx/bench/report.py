"""A Markdown report of a results file: the machine, the trace, one row per run, and TPGS ratios
against the reference engine."""

from __future__ import annotations

from agentx.bench.results import Results

_COLUMNS = (
    ("engine", "engine", "{}"),
    ("conc.", "concurrency", "{}"),
    ("requests", "num_requests", "{}"),
    ("failed", "num_failed", "{}"),
    ("wall s", "wall_time", "{:.1f}"),
    ("TPGS tok/s", "tpgs", "{:.0f}"),
    ("out tok/s", "output_tokens_per_s", "{:.1f}"),
    ("TTFT P50 s", "ttft_p50", "{:.2f}"),
    ("TTFT P90 s", "ttft_p90", "{:.2f}"),
    ("inter. P50 tok/s", "interactivity_p50", "{:.1f}"),
    ("inter. P90 tok/s", "interactivity_p90", "{:.1f}"),
    ("hit achieved", "achieved_hit_rate", "{:.1%}"),
    ("hit theoretical", "theoretical_hit_rate", "{:.1%}"),
    ("recomputed tok", "num_recomputed_tokens", "{}"),
    ("drafts accepted", "draft_acceptance", "{:.1%}"),
)


def _cell(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def markdown(results: Results, floor: float) -> str:
    h = results.header
    m, v, t = h.get("machine", {}), h.get("versions", {}), h.get("trace", {})
    stats = t.get("stats", {})
    lines = [
        f"# agentx bench: {t.get('id', '?')}",
        "",
        f"- machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('ram_gib')} GiB RAM, "
        f"load {m.get('loadavg_1m')}",
        f"- versions: python {v.get('python')}, torch {v.get('torch')}, agentx {v.get('agentx')} "
        f"({v.get('git')})",
        f"- trace: {stats.get('num_sessions')} sessions, {stats.get('num_requests')} requests, "
        f"{stats.get('num_prompt_tokens')} prompt + {stats.get('num_output_tokens')} output "
        f"tokens, theoretical hit rate {stats.get('theoretical_hit_rate', 0):.1%}",
        f"- command: `{' '.join(h.get('command', []))}`",
        "",
        "| " + " | ".join(c[0] for c in _COLUMNS) + " |",
        "|" + "---|" * len(_COLUMNS),
    ]
    for metrics in results.metrics:
        d = metrics.to_json()
        row = [_cell(fmt, d[key]) for _, key, fmt in _COLUMNS]
        if metrics.interrupted:
            row[0] += " (interrupted)"
        lines.append("| " + " | ".join(row) + " |")
    lines += _think_bound(results)
    summary = results.summary(floor)
    lines += ["", f"TPGS at interactivity P90 >= {floor:g} tok/s:"]
    for engine, value in summary["tpgs_at_floor"].items():
        lines.append(f"- {engine}: {_cell('{:.0f} tok/s', value)}")
    if len(summary["ratios"]) > 1:
        lines += ["", f"TPGS ratio vs {summary['ratios_vs']} (per concurrency):"]
        for engine, ratios in summary["ratios"].items():
            cells = ", ".join(f"c={c}: {r:.2f}x" for c, r in ratios.items())
            lines.append(f"- {engine}: {cells or '-'}")
    return "\n".join(lines) + "\n"


def _think_bound(results: Results) -> list[str]:
    """The trace's ceiling at each concurrency (think times alone, no engine time) and each run's
    wall time against it."""
    t = results.header.get("trace", {})
    bound, stats = t.get("think_bound_s"), t.get("stats", {})
    if not bound or not any(bound.values()):
        return []
    tokens = stats.get("num_prompt_tokens", 0) + stats.get("num_output_tokens", 0)
    cells = ", ".join(
        f"c={c}: {s:.1f} s (TPGS <= {tokens / s:,.0f})" for c, s in bound.items() if s > 0
    )
    lines = ["", f"Think-time bound (the wall time of an engine that takes no time): {cells}."]
    shares: dict[str, list[str]] = {}
    for m in results.metrics:
        s = bound.get(str(m.concurrency))
        if s and m.wall_time > 0:
            shares.setdefault(m.engine, []).append(f"c={m.concurrency}: {s / m.wall_time:.0%}")
    if shares:
        lines.append("Bound / wall time (100% is the ceiling):")
        lines += [f"- {engine}: {', '.join(share)}" for engine, share in shares.items()]
    return lines
