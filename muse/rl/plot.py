"""The curves of a GRPO run: each step's mean reward and the held-out accuracy where it was
measured, from the run's metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from muse.plot_png import save_figure

PLOT_FILE = "grpo.png"


def plot_grpo(metrics_path: Path, png_path: Path, title: str = "") -> bool:
    """Write the PNG; False when there is nothing to plot (or no matplotlib)."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line]
    steps = [r for r in records if "reward_mean" in r]
    evaluated = [r for r in records if r.get("eval_accuracy") is not None]
    if not steps and not evaluated:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps],
              label="mean reward of the step's rollouts", color="tab:blue", alpha=0.7)
    axis.plot([r["step"] for r in evaluated], [r["eval_accuracy"] for r in evaluated],
              "o-", label="held-out accuracy (greedy)", color="tab:red")
    axis.set_xlabel("optimizer step")
    axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    axis.set_title(title or "GRPO with LoRA")
    figure.tight_layout()
    save_figure(figure, png_path, dpi=120)
    plt.close(figure)
    return True
