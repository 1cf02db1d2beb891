"""PNG plots of a results file (matplotlib, Agg backend, imported only when plotting):
TPGS vs concurrency, interactivity P50 vs TPGS, TTFT CDF, hit rate per engine."""

from __future__ import annotations

from pathlib import Path

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
    metrics = results.metrics
    engines = list(dict.fromkeys(m.engine for m in metrics))
    by_engine = {
        e: sorted((m for m in metrics if m.engine == e), key=lambda m: m.concurrency)
        for e in engines
    }
    paths = []

    def save(fig, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(6, 4))
    for e, ms in by_engine.items():
        ax.plot([m.concurrency for m in ms], [m.tpgs for m in ms], marker="o", label=e)
    ax.set(xlabel="concurrent session trees", ylabel="TPGS (tokens/s/device)", title="TPGS")
    ax.legend()
    save(fig, "tpgs_vs_concurrency.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for e, ms in by_engine.items():
        ax.plot([m.tpgs for m in ms], [m.interactivity_p50 or 0 for m in ms], marker="o", label=e)
    ax.set(
        xlabel="TPGS (tokens/s/device)",
        ylabel="interactivity P50 (tok/s/request)",
        title="interactivity vs throughput",
    )
    ax.legend()
    save(fig, "interactivity_vs_tpgs.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for run, m in zip(results.runs, metrics, strict=True):
        ttfts = sorted(r.ttft for r in run.records if r.ok and r.ttft is not None)
        if ttfts:
            ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax.step(ttfts, ys, where="post", label=f"{m.engine} c={m.concurrency}")
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    ax.legend(fontsize=7)
    save(fig, "ttft_cdf.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{m.engine}\nc={m.concurrency}" for m in metrics]
    xs = range(len(metrics))
    ax.bar(
        [x - 0.2 for x in xs], [m.achieved_hit_rate or 0 for m in metrics], 0.4, label="achieved"
    )
    ax.bar(
        [x + 0.2 for x in xs], [m.theoretical_hit_rate for m in metrics], 0.4, label="theoretical"
    )
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set(ylabel="prefix hit rate", ylim=(0, 1), title="prefix cache hit rate")
    ax.legend()
    save(fig, "hit_rate.png")
    return paths
