"""The loss-curve figure of a training run, drawn from its train_log.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from muse.plot_png import save_figure


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(log_path: Path, png_path: Path, title: str = "") -> bool:
    """Write the loss curves (overall and per data source) and the learning rate to a PNG.

    Returns False, writing nothing, where matplotlib is not installed: plotting is a report,
    and training must not depend on it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    records = read_log(log_path)
    if not records:
        return False
    steps = [r["step"] for r in records]
    figure, (losses, rates) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                           gridspec_kw={"height_ratios": [3, 1]})
    losses.plot(steps, [r["loss"] for r in records], label="all (masked mean)", color="black")
    for name in sorted({k for r in records for k in r if k.startswith("loss_")}):
        values = [(r["step"], r[name]) for r in records if r.get(name) is not None]
        losses.plot([s for s, _ in values], [v for _, v in values], label=name[5:],
                    linewidth=0.9)
    losses.set_yscale("log")
    losses.set_ylabel("cross-entropy (nats/token)")
    losses.grid(True, which="both", alpha=0.3)
    losses.legend()
    losses.set_title(title or "training loss")
    rates.plot(steps, [r["lr"] for r in records], color="tab:gray")
    rates.set_ylabel("learning rate")
    rates.set_xlabel("step")
    rates.grid(True, alpha=0.3)
    figure.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(figure, png_path, dpi=110)
    plt.close(figure)
    return True
