"""The PNG figures the tools write: a run's loss curve (train.py, RUN/loss.png), several runs' loss curves
in one picture (plot.py) and perplexity against evaluation length (eval.py, RUN/eval/stepN-perplexity.png).
matplotlib, files only (no display).
"""
from __future__ import annotations

import io

X_AXES = {"step": "step", "tokens": "tokens trained"}  # what a loss curve may be drawn against: its label


def losses(rows: list[dict], title: str) -> bytes:
    """A PNG of the training loss of each logged step and the validation loss of each evaluation, by step
    (a mixture's: a line for each source too; a DPO run's: its reward accuracy too, on an axis of its own)."""
    ax = axes()
    draw_losses(ax, rows)
    ax.set_xlabel(X_AXES["step"])
    dpo = [r for r in rows if "rewards/accuracies" in r]
    ax.set_ylabel("DPO loss (nats per pair)" if dpo else "loss (nats per token)")
    if dpo:  # DPO: the reward accuracy on its own axis, on the right
        right = ax.twinx()
        right.plot([r["step"] for r in dpo], [r["rewards/accuracies"] for r in dpo], color="C3", linewidth=1,
                   alpha=0.6, label="train reward accuracy")
        val = [r for r in rows if "val_rewards/accuracies" in r]
        if val:
            right.plot([r["step"] for r in val], [r["val_rewards/accuracies"] for r in val], color="C3", marker="o",
                       label="validation reward accuracy")
        right.set_ylim(0, 1)
        right.set_ylabel("reward accuracy")
        right.legend(loc="lower left")
    return png(ax, title)


def compare(runs: dict[str, list[dict]], x: str, title: str) -> bytes:
    """A PNG of several runs' losses in one picture, {label: metrics rows}: each run in a colour of its own,
    its training loss a thin line, its validation loss points joined, against `x` (a key of X_AXES, each row
    holding it)."""
    ax = axes(size=(8, 5))
    for i, (label, rows) in enumerate(runs.items()):
        draw_losses(ax, rows, x=x, label=f"{label}: ", color=f"C{i % 10}", sources=False)
    ax.set_xlabel(X_AXES[x])
    ax.set_ylabel("loss (nats per token)")
    return png(ax, title)


def draw_losses(ax, rows: list[dict], x: str = "step", label: str = "", color=None, sources: bool = True) -> None:
    """One run's lines on `ax`: the training loss of each logged row and the validation loss of each
    evaluation against the rows' `x`, each line's label after `label`; `sources`: a mixture's validation
    loss of each source too."""
    ax.plot([r[x] for r in rows], [r["loss"] for r in rows], label=f"{label}train loss", linewidth=1, color=color,
            alpha=0.6 if color else None)
    val = [r for r in rows if "val_loss" in r]
    names = sorted({k.split("/", 1)[1] for r in val for k in r if k.startswith("val_loss/")}) if sources else []
    if val:
        ax.plot([r[x] for r in val], [r["val_loss"] for r in val], marker="o", color=color,
                label=f"{label}validation loss" + (" (all sources)" if names else ""))
    for name in names:  # a mixture: each source's own validation loss
        each = [r for r in val if f"val_loss/{name}" in r]
        ax.plot([r[x] for r in each], [r[f"val_loss/{name}"] for r in each], marker=".", linestyle="--",
                label=f"{label}validation loss: {name}")


def perplexity(series: dict[str, list[dict]], train_len: int, title: str) -> bytes:
    """A PNG of perplexity against evaluation length (log2 axis), one line per {label: rows}, the training
    context marked."""
    ax = axes()
    for label, rows in series.items():
        rows = sorted(rows, key=lambda r: r["length"])
        ax.plot([r["length"] for r in rows], [r["ppl"] for r in rows], marker="o", label=label)
    ax.axvline(train_len, color="grey", linestyle="--", label=f"training context ({train_len})")
    ax.set_xscale("log", base=2)
    lengths = sorted({r["length"] for rows in series.values() for r in rows})
    ax.set_xticks(lengths, labels=[str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    return png(ax, title)


def axes(size: tuple[float, float] = (6, 4)):
    """The axes of a new figure of `size` inches at 120 dpi (matplotlib's Agg: files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size, dpi=120)[1]


def png(ax, title: str) -> bytes:
    """The PNG of `ax`'s figure, titled, with its legend and a light grid; the figure is closed."""
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig = ax.figure
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()
