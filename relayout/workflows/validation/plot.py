"""The predicted-vs-measured plot of a validation (the ``plots`` extra: matplotlib).

:func:`write_validation_plot` draws one point per cell (ms/token, bars spanning the repetitions)
with y = x and the verdict's tolerance band; :func:`plotting` is pyplot on the Agg backend, or the
one-line error naming the extra.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from containers.atomic import atomic_output, make_dirs
from containers.errors import InputError

from .rules import TOLERANCE


def plotting():
    """matplotlib's pyplot (Agg backend), or the one-line error naming the ``plots`` extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError(None, "--plots needs matplotlib: pip install 'relayout[plots]'") from None
    return plt


def write_validation_plot(record: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Predicted vs measured S, one point per cell (ms/token; bars span the repetitions), with
    y = x and the verdict's +/-:data:`TOLERANCE` band. PNG written crash-safely; needs the ``plots`` extra."""
    plt = plotting()
    out = make_dirs(out_dir)
    cells = record["cells"]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    markers = {"none": "o", "oracle": "^", "coupled": "s"}
    colors = {"stock": "tab:gray", "louvain": "tab:blue", "random": "tab:orange"}
    seen = set()
    top = 0.0
    for c in cells:
        x = c["measured_stall_per_token_s"]["mean"] * 1e3
        reps = [v * 1e3 for v in c["measured_stall_per_token_s"]["repetitions"]]
        y = c["predicted_stall_per_token_s"] * 1e3
        top = max(top, x, y, *reps)
        label = f"{c['layout']}, prefetch {c['prefetch']}"
        ax.errorbar([x], [y], xerr=[[x - min(reps)], [max(reps) - x]], fmt=markers.get(c["prefetch"], "o"),
                    color=colors.get(c["layout"], "black"), label=None if label in seen else label, capsize=3)
        seen.add(label)
    top = top * 1.1 or 1.0
    line = np.array([0.0, top])
    ax.plot(line, line, color="black", linewidth=1, label="predicted = measured")
    ax.fill_between(line, line * (1 - TOLERANCE), line * (1 + TOLERANCE), color="tab:green", alpha=0.15,
                    label=f"+/-{TOLERANCE:.0%} (the model holds inside)")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured S (ms per committed token)")
    ax.set_ylabel("predicted S (ms per committed token)")
    ax.set_title(f"Replay model vs measurement on {record['device']['name']}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    path = out / "validation_predicted_vs_measured.png"
    try:
        with atomic_output(path) as fh:
            fig.savefig(fh, dpi=110, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return [path]

