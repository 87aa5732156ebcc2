"""The simulation report as a picture: every node's validation loss over its steps."""

from pathlib import Path
from typing import Any


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Write a PNG of the loss curves in ``report``; ValueError if it holds none."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (CI, servers)
    from matplotlib import pyplot as plt

    curves = [(n.get("name") or n["peer_id"][-8:], n.get("loss_curve") or []) for n in report["nodes"]]
    curves = [(name, curve) for name, curve in curves if curve]
    if not curves:
        raise ValueError("the report has no loss curves (was --algorithm none?)")
    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    for name, curve in curves:
        steps, losses = zip(*curve, strict=True)
        axes.plot(steps, losses, marker="o", markersize=3, linewidth=1.5, label=name)
    axes.set_xlabel("inner step")
    axes.set_ylabel("validation loss (nats/byte)")
    algorithm = report.get("algorithm", "?")
    axes.set_title(f"{len(curves)} nodes, {algorithm}, {report.get('wall_s', 0):.0f} s")
    axes.grid(True, alpha=0.3)
    axes.legend(ncols=2 if len(curves) > 8 else 1, fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
