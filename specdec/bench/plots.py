"""The bench's figures: speed-up by category, first-rejection positions, speed-up against k."""

from __future__ import annotations

import statistics
from pathlib import Path

from specdec.bench.report import speedups


def _save(fig, ax, path: Path, title: str, paths: list[Path]) -> None:
    """Title, lay out, write and close one figure; record its path."""
    import matplotlib.pyplot as plt

    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)


def write_plots(runs: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    sp = speedups(runs, "plain")
    methods = [m for m in dict.fromkeys(r["method"] for r in runs) if "_k" not in m]
    categories = list(dict.fromkeys(r["category"] for r in runs))
    if sp:
        fig, ax = plt.subplots(figsize=(11, 4.5))
        width = 0.8 / max(1, len(methods))
        for j, m in enumerate(methods):
            vals = [sp.get((m, c, 0.0), 0.0) for c in categories]
            ax.bar([i + j * width for i in range(len(categories))], vals, width, label=m)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(categories))], categories)
        ax.set_ylabel("speed-up vs specdec plain (greedy)")
        ax.legend(fontsize=7, ncol=3)
        _save(fig, ax, out / "speedup_by_category.png", "Speed-up by category and method", paths)
    hists: dict[str, list[int]] = {}
    for r in runs:
        acc = r["metrics"].get("acceptance")
        if acc and acc["verify_calls_with_drafts"]:
            h = hists.setdefault(r["method"], [0] * len(acc["first_rejection_histogram"]))
            h.extend([0] * (len(acc["first_rejection_histogram"]) - len(h)))
            for i, c in enumerate(acc["first_rejection_histogram"]):
                h[i] += c
    if any(sum(h) for h in hists.values()):
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # more methods than the default 10 colours
        for m, h in hists.items():
            if sum(h):
                ax.plot(range(len(h)), [c / sum(h) for c in h], marker="o", label=m)
        ax.set_xlabel("position of the first rejected draft (0 = the first draft)")
        ax.set_ylabel("fraction of rejecting calls")
        ax.legend(fontsize=7)
        _save(fig, ax, out / "first_rejection.png", "First-rejection position", paths)
    sweep: dict[str, dict[int, list[float]]] = {}
    for (m, c, t), v in sp.items():
        if "_k" in m and t == 0:
            name, k = m.rsplit("_k", 1)
            sweep.setdefault(name, {}).setdefault(int(k), []).append(v)
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, ks in sweep.items():
            xs = sorted(ks)
            ax.plot(xs, [statistics.median(ks[x]) for x in xs], marker="o", label=name)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xlabel("k (fixed)")
        ax.set_ylabel("speed-up vs plain (median over categories)")
        ax.legend()
        _save(fig, ax, out / "speedup_vs_k.png", "Speed-up against k", paths)
    return paths
