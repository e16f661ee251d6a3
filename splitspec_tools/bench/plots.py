"""PNG plots of a benchmark run: acceptance per draft position, and tokens/s per
configuration. Each figure carries the command line, git revision and machine."""
from __future__ import annotations

from pathlib import Path

from .report import machine_line, temperature_title


def _footer(fig, results: dict) -> None:
    meta = results["meta"]
    text = f"{meta['command']}\ngit {meta['git_revision']} | {machine_line(meta)}"
    fig.text(0.01, 0.01, text, fontsize=6, family="monospace", va="bottom", wrap=True)


def plot(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    temps = results["temperatures"]

    # Acceptance per position, one panel per temperature.
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.6), squeeze=False)
    for ax, block in zip(axes[0], temps):
        for e in results["configs"]:
            if e["temperature"] == block["temperature"] and e["per_position_acceptance"]:
                acc = e["per_position_acceptance"]
                ax.plot(range(1, len(acc) + 1), acc, marker="o",
                        label=f"{e['name']} (τ {e['accept_length']:.2f})")
        ax.set_title(temperature_title(block["temperature"], block["top_p"]))
        ax.set_xlabel("draft position k")
        ax.set_ylabel("share of verify steps accepting position k")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Acceptance per draft position")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    _footer(fig, results)
    paths.append(out_dir / "acceptance.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # Tokens/s per configuration, one panel per temperature, speedups written on the bars.
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.6), squeeze=False)
    for ax, block in zip(axes[0], temps):
        entries = [e for e in results["configs"] if e["temperature"] == block["temperature"]]
        names = [e["name"] for e in entries]
        rates = [e["tokens_per_s"] for e in entries]
        bars = ax.bar(range(len(entries)), rates, color=["#888888" if e["config"] == "target" else "#3b75af"
                                                         for e in entries])
        for bar, e in zip(bars, entries):
            ax.annotate(f"{e['speedup']:.2f}×", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(entries)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("tokens/s (aggregate)")
        ax.set_title(temperature_title(block["temperature"], block["top_p"]))
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Decoding throughput per configuration (speedup vs (a) target-only)")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    _footer(fig, results)
    paths.append(out_dir / "tokens_per_s.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    if results.get("concurrency"):
        fig, ax = plt.subplots(figsize=(6, 4.6))
        for name in dict.fromkeys(c["name"] for c in results["concurrency"]):
            rows = [c for c in results["concurrency"] if c["name"] == name]
            ax.plot([c["streams"] for c in rows], [c["tokens_per_s"] for c in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        levels = sorted({c["streams"] for c in results["concurrency"]})
        ax.set_xticks(levels, [str(x) for x in levels])
        ax.minorticks_off()
        ax.set_xlabel("simultaneous streams")
        ax.set_ylabel("aggregate tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.suptitle("Concurrency sweep")
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        _footer(fig, results)
        paths.append(out_dir / "concurrency.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
