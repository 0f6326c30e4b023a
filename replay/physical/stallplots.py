"""Figures of a STALL_TRACE report: the step-stall CDF, stall per layer, and predicted versus measured S.

Each figure is a PNG written crash-safely; every run has its own legend entry, labelled by its
run id (qualified by its file where two files share one, shortened to :data:`LABEL_CHARS`).
Times are shown in milliseconds per committed token. Needs matplotlib; text output never does.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from containers.atomic import atomic_output, make_dirs
from containers.errors import InputError
from replay.physical.stalltrace import Report, RunMetrics


LABEL_CHARS = 20
"""Longest run label in a figure; longer ones keep their start and end around an ellipsis."""


def _short(text: str) -> str:
    if len(text) <= LABEL_CHARS:
        return text
    keep = (LABEL_CHARS - 1) // 2
    return text[:keep] + "\u2026" + text[-keep:]


def _labels(runs: list[RunMetrics]) -> list[str]:
    """Figure labels: run ids, qualified by file name where two runs share one, each at most
    :data:`LABEL_CHARS` characters (distinct runs keep distinct labels: a number is added where
    shortening made two equal)."""
    ids = [m.run_id for m in runs]
    full = [f"{Path(m.source).name}:{m.run_id}" if ids.count(m.run_id) > 1 else m.run_id for m in runs]
    short = [_short(x) for x in full]
    return [f"{i + 1}. {x}" if short.count(x) > 1 else x for i, x in enumerate(short)]


def _legend_outside(ax) -> None:
    """The legend to the right of the axes, never over the data."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


MAX_LAYER_TICKS = 16
"""At most this many labelled layer ticks, at the default font size."""


def write_plots(r: Report, out_dir: str | Path, predicted: dict | None = None) -> list[Path]:
    """PNG figures: step-stall CDF, stall per layer (one bar per run and layer, side by side), and
    predicted vs measured S (with a gate.json; one bar per measured run). Every run has its own
    legend entry.

    Needs matplotlib (``pip install 'relayout[plots]'``); text output never does.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError(None, "--plots needs matplotlib: pip install 'relayout[plots]'") from None
    out = make_dirs(out_dir)
    written = []
    labels = _labels(r.runs)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, label in zip(r.runs, labels):
        per = np.sort(m.step_stall / m.step_committed) / 1e6
        ax.plot(per, np.arange(1, len(per) + 1) / max(len(per), 1), label=label)
    ax.set_xlabel("stall per committed token in a step (ms)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("Step stall CDF")
    _legend_outside(ax)
    written.append(_save(fig, out / "stall_cdf.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    layers = sorted({l for m in r.runs for l in m.layer_stall})
    pos = np.arange(len(layers))
    width = 0.8 / max(len(r.runs), 1)
    for i, (m, label) in enumerate(zip(r.runs, labels)):
        vals = [m.layer_stall.get(l, 0) / max(m.committed_tokens, 1) / 1e6 for l in layers]
        ax.bar(pos - 0.4 + (i + 0.5) * width, vals, width, label=label)
    every = max(1, math.ceil(len(layers) / MAX_LAYER_TICKS))
    ax.set_xticks(pos[::every], [str(l) for l in layers[::every]])
    ax.set_xlabel("layer")
    ax.set_ylabel("stall per committed token (ms)")
    ax.set_title("Stall per layer")
    _legend_outside(ax)
    written.append(_save(fig, out / "stall_per_layer.png"))
    if predicted is not None:
        fig, ax = plt.subplots(figsize=(max(5, 1.2 * (2 + len(r.runs))), 4))
        pred = [predicted["baseline_metrics"]["stall_per_token_s"] * 1e3, predicted["plan_metrics"]["stall_per_token_s"] * 1e3]
        ax.bar([0, 1], pred, 0.8, color="tab:gray", label="predicted (gate.json)")
        colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["tab:blue"])
        for i, (m, label) in enumerate(zip(r.runs, labels)):
            ax.bar([2 + i], [m.stall_per_committed_token_ns / 1e6], 0.8, color=colors[i % len(colors)], label=f"measured {label}")
        ax.set_xticks(np.arange(2 + len(r.runs)), ["predicted baseline", "predicted plan"] + [f"measured {x}" for x in labels])
        ax.set_ylabel("S (ms per committed token)")
        ax.set_title("Predicted vs measured stall")
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
        _legend_outside(ax)
        written.append(_save(fig, out / "predicted_vs_measured.png"))
    return written


def _save(fig, path: Path) -> Path:
    """Write a figure crash-safely (temp, fsync, rename); a full disk is one clear error."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        with atomic_output(path) as fh:
            fig.savefig(fh, dpi=110, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return path
