"""The PNG figures the tools write: a run's loss curve (train.py, RUN/loss.png) and perplexity against
evaluation length (eval.py, RUN/eval/stepN-perplexity.png). matplotlib, files only (no display).
"""
from __future__ import annotations

import io


def losses(rows: list[dict], title: str) -> bytes:
    """A PNG of the training loss of each logged step and the validation loss of each evaluation, by step
    (a mixture's: a line for each source too)."""
    ax = axes()
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss", linewidth=1)
    val = [r for r in rows if "val_loss" in r]
    sources = sorted({k.split("/", 1)[1] for r in val for k in r if k.startswith("val_loss/")})
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], marker="o",
                label="validation loss" + (" (all sources)" if sources else ""))
    for name in sources:  # a mixture: each source's own validation loss
        each = [r for r in val if f"val_loss/{name}" in r]
        ax.plot([r["step"] for r in each], [r[f"val_loss/{name}"] for r in each], marker=".", linestyle="--",
                label=f"validation loss: {name}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    return png(ax, title)


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


def axes():
    """The axes of a new 6 x 4 inch figure at 120 dpi (matplotlib's Agg: files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, 4), dpi=120)[1]


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
