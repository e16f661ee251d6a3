"""PNG plots of a `splitspec bench` run: acceptance per draft position and tokens/s per
configuration (a panel per temperature), and the concurrency sweep; each carries the command line,
git revision and machine."""
from __future__ import annotations

from pathlib import Path

from .harness import machine_line


def plot(r: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, name: str) -> Path:
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        fig.text(0.01, 0.01, f"{r['meta']['command']}\ngit {r['meta']['git_revision']} | {machine_line(r['meta'])}",
                 fontsize=6, family="monospace", va="bottom", wrap=True)
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        return out / name

    temps, paths = r["temperatures"], []
    fig, axes = plt.subplots(2, len(temps), figsize=(6 * len(temps), 9), squeeze=False)
    for col, t in enumerate(temps):
        entries = [e for e in r["configs"] if e["temperature"] == t]
        for e in entries:
            if e["per_position_acceptance"]:
                acc = e["per_position_acceptance"]
                axes[0][col].plot(range(1, len(acc) + 1), acc, marker="o",
                                  label=f"{e['name']} (τ {e['tau']:.2f})")
        axes[0][col].set(title=f"T={t:g}: acceptance per draft position", xlabel="draft position k",
                         ylabel="share of verify steps accepting k", ylim=(0, 1.02))
        if entries and any(e["per_position_acceptance"] for e in entries):
            axes[0][col].legend(fontsize=8)
        bars = axes[1][col].bar(range(len(entries)), [e["tokens_per_s"] for e in entries])
        for bar, e in zip(bars, entries):
            axes[1][col].annotate(f"{e['speedup']:.2f}×", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                  ha="center", va="bottom", fontsize=8)
        axes[1][col].set_xticks(range(len(entries)), [e["name"] for e in entries], rotation=30, ha="right", fontsize=8)
        axes[1][col].set(title=f"T={t:g}: tokens/s (speed-up vs target-only)", ylabel="tokens/s")
    paths.append(save(fig, "configs.png"))
    if r["concurrency"]:
        fig, ax = plt.subplots(figsize=(6, 4.6))
        for name in dict.fromkeys(c["name"] for c in r["concurrency"]):
            rows = [c for c in r["concurrency"] if c["name"] == name]
            ax.plot([c["streams"] for c in rows], [c["tokens_per_s"] for c in rows], marker="o", label=name)
        ax.set(xscale="log", xlabel="simultaneous streams", ylabel="aggregate tokens/s", title="Concurrency sweep")
        ax.legend(fontsize=8)
        paths.append(save(fig, "concurrency.png"))
    return paths
