"""The simulation report as a picture: every node's validation loss over its steps.

Each curve's points are the loss on the same validation blocks (training/validation.py);
a node's full validation of its final model (the whole split) is a separate marker at its
last step, labelled as such: the two measure different blocks, and are never joined."""

from pathlib import Path
from typing import Any

from node.simulate.report import shared


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Write a PNG of the loss curves in ``report``; ValueError if it holds none."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (CI, servers)
    from matplotlib import pyplot as plt

    curves = [(n.get("name") or n["peer_id"][-8:], n.get("loss_curve") or []) for n in report["nodes"]]
    curves = [(name, curve) for name, curve in curves if curve]
    if not curves:
        raise ValueError("the report has no loss curves (was --algorithm none?)")
    fulls = {n.get("name") or n["peer_id"][-8:]: n.get("full_val_loss") for n in report["nodes"]}
    num_rows = shared([n for n in report["nodes"] if n.get("loss_curve")], "val_rows")
    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    marked = False
    for name, curve in curves:
        steps, losses = zip(*curve, strict=True)
        (line,) = axes.plot(steps, losses, marker="o", markersize=3, linewidth=1.5, label=name)
        full = fulls.get(name)
        if isinstance(full, float):
            axes.plot([steps[-1]], [full], marker="x", markersize=8, linestyle="", color=line.get_color())
            marked = True
    if marked:  # one legend entry for every node's marker, after the nodes'
        axes.plot([], [], marker="x", markersize=8, linestyle="", color="black", label="full validation, final model")
    axes.set_xlabel("inner step")
    blocks = "the same blocks" if num_rows is None else f"the same {num_rows} blocks"
    axes.set_ylabel(f"validation loss on {blocks} (nats/token)")
    algorithm = report.get("algorithm", "?")
    axes.set_title(f"{len(curves)} nodes, {algorithm}, {report.get('wall_s', 0):.0f} s")
    axes.grid(True, alpha=0.3)
    axes.legend(ncols=2 if len(curves) > 8 else 1, fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
