"""A replay whose memory does not grow with the trace: chunks of whole forwards in, per-step sums out.

:func:`replay_steps` feeds :class:`replay.model.engine.Replay` one chunk of instances at a time
(:func:`replay.model.unions.chunk_instances`) and reduces each chunk's per-instance outputs to sums per
step (forward) at once (:func:`replay.model.metrics.step_sums`), so what it holds is the layout's
[L, E] arrays, one chunk's instances and outputs, and the [N] step table of the evaluated
forwards: a few MB per 100,000 steps. The rows come from a trace in memory or, streamed from its
file, from :meth:`replay.formats.trace.TraceFile.row_blocks`, so a trace larger than RAM replays too.
The results are the same, to the bit, as :func:`replay.model.engine.simulate` followed by
:func:`replay.model.metrics.step_table`, whatever the chunk size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from containers.layout import Layout

from replay.model.config import RuntimeConfig
from replay.model.device import ArrayProfile
from replay.model.engine import DeviceUsage, Replay, SplitState
from replay.model.metrics import StepTable, step_sums, steps_from_sums
from replay.model.routing import TraceSource
from replay.model.unions import (
    DEFAULT_CHUNK_FORWARDS,
    RowBlock,
    chunk_instances,
    realign_blocks,
    whole_forward_blocks,
)


@dataclass
class StepReplay:
    """A streamed replay's results: the step table, the device totals, and ``expert_wait``
    [L, E] (s the compute thread waited right before each expert's matmul, over the replay)."""

    steps: StepTable
    usage: DeviceUsage
    expert_wait: np.ndarray


def replay_steps(
    trace: TraceSource,
    forwards: np.ndarray,
    layout: Layout,
    device: ArrayProfile,
    config: RuntimeConfig,
    pinned: np.ndarray | None = None,
    split: SplitState | None = None,
    coupling: tuple | None = None,
    *,
    chunk_forwards: int = DEFAULT_CHUNK_FORWARDS,
    blocks: Iterable[RowBlock] | None = None,
) -> StepReplay:
    """Replay the forwards of mask ``forwards`` [F] chunk by chunk, keeping per-step sums only.

    ``trace`` gives the forwards (sessions, committed and evaluated counts) and, unless
    ``blocks`` is given, the rows (then it must be a :class:`replay.model.routing.RoutingTrace`), in
    chunks of ``chunk_forwards`` forwards. ``blocks``: the trace's rows in consecutive blocks
    (:meth:`replay.model.routing.TraceSource.row_blocks`, from memory or streamed from the file, as
    :func:`replay.evaluation.gate.run_layout` passes them), recut at forward boundaries. ``pinned``, ``split``,
    ``coupling``: as :func:`replay.model.engine.simulate`.

    Parameters
    ----------
    trace : TraceSource
        The forwards and, without ``blocks``, the rows.
    forwards : bool array [F]
        The forwards to replay.
    layout, device, config : Layout, ArrayProfile, RuntimeConfig
        As :func:`replay.model.engine.simulate`.
    pinned, split, coupling : optional
        As :func:`replay.model.engine.simulate`.
    chunk_forwards : int, keyword-only
        Forwards per chunk.
    blocks : iterable of RowBlock, keyword-only
        The trace's rows in consecutive blocks.

    Returns
    -------
    StepReplay
        The step table, the device totals and the per-expert waits.
    """
    replay = Replay(layout, device, config, pinned, split, coupling)
    fw = np.flatnonzero(forwards)
    step_of = np.full(len(forwards), -1, dtype=np.int64)
    step_of[fw] = np.arange(len(fw))
    sums = None
    rows = realign_blocks(blocks) if blocks is not None else whole_forward_blocks(trace, chunk_forwards)
    for inst in chunk_instances(rows, forwards, trace.fwd_session, layout):
        out = replay.run(inst)
        first = int(step_of[inst.forward[0]])
        local = step_of[inst.forward] - first
        n = int(local[-1]) + 1
        part = step_sums(local, n, out.instance, out.prefetch if config.prefetch != "none" else None)
        if sums is None:
            sums = {name: np.zeros(len(fw)) for name in part}
        for name, x in part.items():
            sums[name][first:first + n] = x
    if sums is None:
        empty = np.zeros(0, dtype=np.int64)
        sums = step_sums(empty, len(fw), replay.totals.instance, replay.totals.prefetch if config.prefetch != "none" else None)
    return StepReplay(steps_from_sums(trace, forwards, sums), replay.usage(), replay.expert_wait)
