"""The harness's STALL_TRACE writer: expert and step records, streamed to a crash-safe file.

Records are JSONL (zstd-compressed when the file name ends in ``.zst``), the form
:mod:`replay.physical.stalltrace` reads. Every expert record carries its step's
``evaluated_positions`` and ``committed_tokens``, its ``foreground_stall_ns`` (the compute
thread's wait for it), its ``tier_served`` (``nvme`` when any of its bytes came from the drive,
``os_cache`` when all came from the page cache, ``ram`` for LRU hits) and its reads
(:class:`replay.physical.reader.IoTally`, the ``drive_*``, ``page_cache_*`` and
``unclassified_*`` requests and bytes; a coalesced weight read shared by a run of experts counts
on the first of them). A step's expert
records are held until its step record and encoded with it, once its last layer is done. The
file is written to a temporary name and renamed into place on success only. Times in monotonic
nanoseconds; bytes.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import zstandard

from containers.atomic import atomic_output

from replay.physical.reader import IO_ZERO, IoTally


@dataclass(frozen=True)
class StepId:
    """What every record of one measured step carries: the run, the request (session), the step
    (the trace's forward index) and the step's counts (tokens committed, positions evaluated)."""

    run_id: str
    request_id: str
    step: int
    committed_tokens: int
    evaluated_positions: int


class StallTraceWriter:
    """Streams records to a (zstd) JSONL temp file, renamed into place on success only.

    A step's expert records are held until its step record and encoded with it, once its last
    layer is done: encoding them between the compute thread's waits would add time the compute
    model does not have (and lengthen the window a prefetch load has before the next layer is
    routed).

    Parameters
    ----------
    out : path or None
        The STALL_TRACE to write; None (or ``record`` False) writes nothing.
    record : bool
        Whether to write records at all.
    """

    def __init__(self, out, record: bool):
        self.out = Path(out) if out is not None and record else None
        self.stack = contextlib.ExitStack()
        self.held: list[dict] = []
        self.fh = self.z = None
        if self.out is not None:
            self.fh = self.stack.enter_context(atomic_output(self.out, "wb"))
            if self.out.suffix == ".zst":
                self.z = zstandard.ZstdCompressor(level=3).stream_writer(self.fh, closefd=False)

    def _write(self, rec: dict) -> None:
        if self.out is not None:
            (self.z or self.fh).write((json.dumps(rec, separators=(",", ":")) + "\n").encode())

    def expert(self, sid: StepId, layer: int, e: int, *, required: bool, nbytes: int, issue: int, ready: int,
               need: int, tier: str, priority: str = "demand", stall: int = 0, io: IoTally = IO_ZERO) -> None:
        """Hold an expert record of step ``sid``: expert ``e`` of model layer ``layer``, ``nbytes``
        of it, ``required`` by the step or not (a prefetch load the layer did not select), its
        first read issued at ``issue`` and its bytes ready at ``ready``, needed by the compute at
        ``need``, the compute thread's wait for it ``stall`` (ns), served from ``tier``, loaded as
        ``priority`` (``demand`` or ``speculative``), its reads ``io``."""
        if self.out is None:
            return
        rec = {"run_id": sid.run_id, "request_id": sid.request_id, "step": sid.step, "layer": layer, "expert_id": e,
               "segment_id": 0, "evaluated_positions": sid.evaluated_positions, "committed_tokens": sid.committed_tokens,
               "required": required, "bytes": nbytes, "issue_ns": issue, "ready_ns": ready, "need_ns": need,
               "foreground_stall_ns": stall,
               "tier_served": tier, "tier_at_prediction": "ram" if tier == "ram" else "os_cache_unknown", "priority": priority,
               "prediction_source": "demand" if priority == "demand" else "prefetch",
               "used_before_eviction": required, "cancelled": False}
        rec.update(io.to_json())
        self.held.append(rec)

    def _write_held(self) -> None:
        for rec in self.held:
            self._write(rec)
        self.held = []

    def step(self, sid: StepId, *, compute_ns: int, wall_ns: int, stall_ns: int, assumed: bool = False,
             configuration: str | None = None) -> None:
        """Write the held expert records of step ``sid``, then its step record: its emulated
        compute, wall time and stall (ns; ``other_ns`` is the rest of the wall time), whether its
        committed count was ``assumed``, and the run's ``configuration``."""
        self._write_held()
        self._write({"record": "step", "run_id": sid.run_id, "request_id": sid.request_id, "step": sid.step,
                     "committed_tokens": sid.committed_tokens, "evaluated_positions": sid.evaluated_positions,
                     "committed_assumed": assumed, "compute_ns": compute_ns, "stall_ns": stall_ns,
                     "other_ns": max(0, wall_ns - compute_ns - stall_ns), "wall_ns": wall_ns, "token_hashes": None,
                     "configuration": configuration})

    def close(self) -> Path | None:
        """Write what is held, finish the file and rename it into place; returns its path (None when none)."""
        self._write_held()
        if self.z is not None:
            self.z.flush(zstandard.FLUSH_FRAME)
        self.stack.close()
        return self.out

    def abort(self, exc: BaseException) -> None:
        """Discard the file: nothing half-written is left looking complete."""
        self.stack.__exit__(type(exc), exc, exc.__traceback__)
