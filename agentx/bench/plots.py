"""PNG plots of a results file (matplotlib, Agg backend, imported only when plotting):
TPGS vs concurrency, interactivity P50 vs TPGS, TTFT CDF, hit rate per engine; a saturation
profile's prefill and decode rates (``plot_saturation``); a P/D sweep (``plot_pd_sweep``)."""

from __future__ import annotations

from pathlib import Path

from agentx.bench.metrics import RunMetrics
from agentx.bench.results import Results


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install 'agentx[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_all(results: Results, out_dir: str | Path) -> list[Path]:
    """Write the four plots into ``out_dir``; returns their paths."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in (
        ("tpgs_vs_concurrency.png", _tpgs_vs_concurrency),
        ("interactivity_vs_tpgs.png", _interactivity_vs_tpgs),
        ("ttft_cdf.png", _ttft_cdf),
        ("hit_rate.png", _hit_rate),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, results)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


def _by_engine(results: Results) -> dict[str, list[RunMetrics]]:
    out: dict[str, list[RunMetrics]] = {}
    for m in results.metrics:
        out.setdefault(m.engine, []).append(m)
    return {e: sorted(ms, key=lambda m: m.concurrency) for e, ms in out.items()}


def _tpgs_vs_concurrency(ax, results: Results) -> None:
    for engine, ms in _by_engine(results).items():
        ax.plot([m.concurrency for m in ms], [m.tpgs for m in ms], marker="o", label=engine)
    ax.set(xlabel="concurrent session trees", ylabel="TPGS (tokens/s/device)", title="TPGS")
    ax.legend()


def _interactivity_vs_tpgs(ax, results: Results) -> None:
    for engine, ms in _by_engine(results).items():
        ys = [m.interactivity_p50 or 0 for m in ms]
        ax.plot([m.tpgs for m in ms], ys, marker="o", label=engine)
    ax.set(
        xlabel="TPGS (tokens/s/device)",
        ylabel="interactivity P50 (tok/s/request)",
        title="interactivity vs throughput",
    )
    ax.legend()


def _ttft_cdf(ax, results: Results) -> None:
    for run, m in zip(results.runs, results.metrics, strict=True):
        ttfts = sorted(r.ttft for r in run.records if r.ok and r.ttft is not None)
        if ttfts:
            ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax.step(ttfts, ys, where="post", label=f"{m.engine} c={m.concurrency}")
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    ax.legend(fontsize=7)


def _hit_rate(ax, results: Results) -> None:
    metrics = results.metrics
    xs = list(range(len(metrics)))
    achieved = [m.achieved_hit_rate or 0 for m in metrics]
    ax.bar([x - 0.2 for x in xs], achieved, 0.4, label="achieved")
    ax.bar(
        [x + 0.2 for x in xs], [m.theoretical_hit_rate for m in metrics], 0.4, label="theoretical"
    )
    ax.set_xticks(xs, [f"{m.engine}\nc={m.concurrency}" for m in metrics], fontsize=7)
    ax.set(ylabel="prefix hit rate", ylim=(0, 1), title="prefix cache hit rate")
    ax.legend()


def _save(plt, fig, axes, path: str | Path) -> Path:
    """Legends on ``axes``, then the figure written to ``path`` and closed."""
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_saturation(profile: dict, path: str | Path) -> Path:
    """A saturation profile (:mod:`agentx.bench.saturate`): prefill computed tokens/s by prompt
    length (a line per engine and cached fraction), and decode tokens/s against interactivity
    P90 (a line per engine and context, a point per batch; the floor dashed)."""
    plt = _pyplot()
    fig, (pre, dec) = plt.subplots(1, 2, figsize=(11, 4))
    floor = profile["config"]["interactivity_floor"]
    for engine, part in profile["engines"].items():
        for fraction in sorted({p["cached_fraction"] for p in part["prefill"]}):
            ps = [p for p in part["prefill"] if p["cached_fraction"] == fraction]
            xs, ys = [p["prompt_tokens"] for p in ps], [p["computed_tokens_per_s"] for p in ps]
            pre.plot(xs, ys, marker="o", label=f"{engine}, {fraction:.0%} cached")
        for context in sorted({d["context_tokens"] for d in part["decode"]}):
            ds = [d for d in part["decode"] if d["context_tokens"] == context]
            ds = [d for d in ds if d["interactivity_p90"] is not None]
            xs, ys = [d["interactivity_p90"] for d in ds], [d["tokens_per_s"] for d in ds]
            dec.plot(xs, ys, marker="o", label=f"{engine}, {context} tokens")
            for d in ds:
                dec.annotate(f"B={d['batch']}", (d["interactivity_p90"], d["tokens_per_s"]),
                             fontsize=6)  # fmt: skip
    pre.set(xlabel="prompt tokens", ylabel="computed tokens/s", title="prefill-only")
    dec.axvline(floor, linestyle="--", color="grey")
    dec.set(xlabel="interactivity P90 (tok/s/request)", ylabel="output tokens/s",
            title="decode-only (point per batch)")  # fmt: skip
    return _save(plt, fig, (pre, dec), path)


def plot_pd_sweep(rows: list[dict], floor: float, path: str | Path) -> Path:
    """A P/D sweep (benchmarks/pd_sweep.py): per split, predicted against measured tokens/s per
    worker (bars; no predicted bar without a profile), and interactivity P90 against TPGS (a
    point per split; the floor dashed). ``rows``: dicts with ``split``, ``predicted`` (tok/s
    per worker or None), ``tpgs`` and ``interactivity_p90`` (None: no request had 2 tokens)."""
    plt = _pyplot()
    fig, (bars, tradeoff) = plt.subplots(1, 2, figsize=(11, 4))
    xs = list(range(len(rows)))
    predicted = [r["predicted"] or 0 for r in rows]
    bars.bar([x - 0.2 for x in xs], predicted, 0.4, label="predicted (profile)")
    bars.bar([x + 0.2 for x in xs], [r["tpgs"] for r in rows], 0.4, label="measured TPGS")
    bars.set_xticks(xs, [r["split"] for r in rows])
    bars.set(ylabel="tokens/s per worker", title="throughput per split")
    for r in rows:
        if r["interactivity_p90"] is not None:
            tradeoff.plot(r["tpgs"], r["interactivity_p90"], marker="o", label=r["split"])
    tradeoff.axhline(floor, linestyle="--", color="grey")
    tradeoff.set(xlabel="TPGS (tokens/s/worker)", ylabel="interactivity P90 (tok/s/request)",
                 title="interactivity vs throughput")  # fmt: skip
    return _save(plt, fig, (bars, tradeoff), path)
