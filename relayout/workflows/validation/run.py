"""``relayout validate PATH``: one validation run, from the prepared containers to the written record.

:func:`validate` prepares the containers (:mod:`.prepare`), reads each once, calibrates the disk
holding ``PATH`` unless a profile is given, predicts every cell (layout x RAM budget x prefetch
source) by replaying exactly the measured held-out steps on the profile, measures each cell
``reps`` times for real, cold, the runs of a RAM budget in lockstep in a counterbalanced order
(:func:`measurement_order`) with the placement control beside them, probes the disk's speed
between repetitions, replays each run under its own conditions (:mod:`.diagnoses`), and writes the
judged ``validation.json`` (:mod:`.record`). The method and the verdict's rules are written out in
``docs/VALIDATION.md``. S in seconds per committed token, rates in bytes/s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
from containers.progress import progress_bar

from containers.atomic import make_dirs, write_json_atomic
from containers.container import Container
from containers.errors import InputError
from replay.model.routing import RoutingTrace
from replay.model.config import RuntimeConfig
from replay.model.device import ArrayProfile
from replay.model.figures import LayoutMetrics
from replay.model.metrics import StepTable

from relayout.render.measurements import MERGE_AGREES, completion_sentence, merge_sentence, small_page_warning

from ..workdir import WorkDir
from .diagnoses import at_harness_compute, at_run_speed, neighbour_scales, probed_drift
from .options import DEFAULT_REPS, DEFAULT_TOKENS, PROBE_TOKENS, ValidateOptions, check_options, choose_size
from .plot import write_validation_plot
from .prepare import PLACEMENT_COPY, Layouts, calibration_target, prepare, probe_target, read_each_once
from .record import Measurement, build_record

WORK_NAME = "relayout-validate"
WORK_MARKER = ".relayout-validate"
CALIBRATION_SECONDS = 0.2
CALIBRATION_MB = 512


@dataclass(frozen=True)
class Prediction:
    """One cell predicted on the profile: its steps (:class:`replay.model.metrics.StepTable`), their
    summary (:class:`replay.model.metrics.LayoutMetrics`), and the demand preads that reach the drives
    per committed token (the model's page cache serves the rest)."""

    steps: StepTable
    summary: LayoutMetrics
    drive_reads_per_token: float


def cells_of(o: ValidateOptions) -> list[tuple]:
    """(prefetch, ram fraction) pairs, in the order the record lists the cells."""
    return [(pf, frac) for pf in o.prefetch for frac in o.ram]


def measurement_order(runs: list, rep: int, block: int) -> list:
    """The order the ``runs`` of one block (every layout x prefetch source at one RAM budget) take
    their first step in, repetition ``rep`` (:func:`replay.physical.measure.measure_interleaved` then
    rotates it by one place each step): rotated by one place per pair of repetitions and per block,
    and reversed in the second repetition of each pair (ABBA counterbalancing). Over a pair every
    run's mean place in the block is the same, so a disk whose speed drifts steadily within a
    round (a throttled cloud volume, a virtual disk) favours no side of any saving, layout or
    prefetch source; with an odd number of repetitions the last one is unpaired.

    >>> measurement_order(["a", "b", "c"], 0, 0), measurement_order(["a", "b", "c"], 1, 0)
    (['a', 'b', 'c'], ['c', 'b', 'a'])
    >>> measurement_order(["a", "b", "c"], 2, 0)
    ['b', 'c', 'a']
    """
    k = (rep // 2 + block) % len(runs)
    order = list(runs[k:]) + list(runs[:k])
    return order[::-1] if rep % 2 else order


def step_order(m, fw: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A measured run's per-step stall (ns) and committed tokens, in the order of forwards ``fw``."""
    index = {int(f): i for i, f in enumerate(fw.tolist())}
    pos = np.array([index.get(int(step), -1) for _, step in m.step_keys], dtype=np.int64)
    if len(pos) != len(fw) or (pos < 0).any() or len(set(pos.tolist())) != len(fw):
        raise InputError(where, f"measured run has {len(pos)} steps that are not the {len(fw)} held-out steps it was given")
    stall = np.zeros(len(fw))
    committed = np.zeros(len(fw))
    stall[pos] = m.step_stall
    committed[pos] = m.step_committed
    return stall, committed


@dataclass(frozen=True)
class Calibrated:
    """The profile predicted on and where it came from; with a calibration, the profile's JSON,
    where it was saved, and its sentences on sharing and merging (:mod:`relayout.render.measurements`)."""

    device: ArrayProfile
    source: str
    path: Path | None = None
    profile: dict | None = None
    sharing: tuple | None = None
    merge: tuple | None = None


def _calibrated(o: ValidateOptions, lay: Layouts, notify) -> Calibrated:
    """The disk holding ``o.path`` calibrated (:func:`.prepare.calibration_target`) and saved."""
    from replay.model.device import load_device
    from replay.physical.calibrate import calibrate

    target = calibration_target(lay.dirs["stock"], o.path)
    notify(f"calibrating the disk holding {o.path} on {target} ({CALIBRATION_SECONDS:g} s per cell"
           + (f", {CALIBRATION_MB} MiB test file)" if target.is_dir() else ", reading it only)"))
    profile = calibrate(target, CALIBRATION_MB, CALIBRATION_SECONDS, f"calibrated-{o.path.resolve().name or 'disk'}")
    profile_path = o.output.with_name(o.output.stem + ".device.json")
    write_json_atomic(profile_path, profile)
    device = load_device(str(profile_path))
    notify(f"wrote {profile_path}")
    sharing, merge = completion_sentence(profile), merge_sentence(profile)
    notes = [small_page_warning(profile), sharing[0] if sharing and sharing[1] else None,
             merge[0] if merge and (merge[1] is None or abs(merge[1] - 1) > MERGE_AGREES) else None]
    for sentence in filter(None, notes):
        notify(sentence[0].upper() + sentence[1:])
    return Calibrated(device, f"calibrated on {target}, saved as {profile_path}", profile_path, profile, sharing, merge)


@dataclass(frozen=True)
class Replayer:
    """Replays the held-out steps of ``mask`` for one cell ``(layout, prefetch, RAM fraction)``
    on a device (:func:`replay.model.engine.simulate`)."""

    trace: RoutingTrace
    mask: np.ndarray
    lay: Layouts
    runtime: RuntimeConfig
    routed: int
    coupling: object | None

    def config(self, pf: str, frac: float) -> RuntimeConfig:
        return replace(self.runtime, ram_bytes=int(self.routed * frac), prefetch=pf)

    def first(self, n: int) -> "Replayer":
        """The same replays on the first ``n`` of its steps."""
        return replace(self, mask=self.mask & (np.cumsum(self.mask) <= n))

    def predict(self, key: tuple, device) -> Prediction:
        """The cell predicted on ``device``."""
        from replay.model.engine import simulate
        from replay.model.metrics import step_table, summarize

        m, pf, frac = key
        inst, usage = simulate(self.trace, self.mask, self.lay.layouts[m], device, self.config(pf, frac),
                               coupling=self.coupling)
        steps = step_table(self.trace, self.mask, inst)
        return Prediction(steps, summarize(steps, usage, 0.0), float(inst.drive_reads.sum() / steps.committed.sum()))

    def stall_and_rate(self, key: tuple, device_at) -> tuple[float, float | None]:
        """S (s/token) predicted for cell ``key`` on ``device_at``, and the rate its drives ran at."""
        from replay.model.engine import simulate
        from replay.model.metrics import drive_rate, step_table, summarize

        m, pf, frac = key
        inst, usage = simulate(self.trace, self.mask, self.lay.layouts[m], device_at, self.config(pf, frac),
                               coupling=self.coupling)
        return summarize(step_table(self.trace, self.mask, inst), usage, 0.0).stall_per_token_s, drive_rate(usage, device_at)

    def stall_at_compute(self, key: tuple, device_at, rate: float) -> tuple[float, float]:
        """S and compute (s/token) predicted for cell ``key`` on ``device_at`` with matmuls at ``rate`` bytes/s."""
        from replay.model.engine import simulate
        from replay.model.metrics import step_table, summarize

        m, pf, frac = key
        cfg = replace(self.config(pf, frac), compute_bytes_per_second=rate)
        inst, usage = simulate(self.trace, self.mask, self.lay.layouts[m], device_at, cfg, coupling=self.coupling)
        summ = summarize(step_table(self.trace, self.mask, inst), usage, 0.0)
        return summ.stall_per_token_s, summ.compute_per_token_s


def _run_figures(run, res, stall: np.ndarray, committed: np.ndarray) -> dict:
    """One measured run as the record's cells read it (s, s/token, bytes/s)."""
    return {
        "stall": stall / 1e9, "committed": committed, "wall_s": res.wall_seconds,
        "tpot_s": (run.published["tpot_ns"] or 0.0) / 1e9,
        "compute_s": (run.published["compute_per_committed_token_ns"] or 0.0) / 1e9,
        "recall": run.published["timely_required_byte_recall"], "cold": res.cold, "direct": res.direct,
        "drive_rate_Bps": run.drive_rate_Bps,
        "page_cache_wait_s": None if run.page_cache_wait_ns is None else run.page_cache_wait_ns / 1e9,
        "drive_reads_per_token": (run.published["reads"] or {}).get("demand", {}).get(
            "drive_requests_per_committed_token"),
    }


@dataclass
class Measured:
    """The measured runs: per cell the runs' figures (:func:`_run_figures`), per RAM fraction the
    placement control's S per repetition, the order they ran in (cell, repetition, block), and
    the probed rates (bytes/s) before the first repetition and after each."""

    runs: dict
    control: dict
    order: list
    rates: list


def _measure(o: ValidateOptions, r: Replayer, *, fw: np.ndarray, reps: int, control_pf: str, run_dir: Path,
             probe: tuple, progress: bool) -> Measured:
    """Every cell measured ``reps`` times, cold: the layouts and prefetch sources of a RAM budget in
    lockstep within each repetition (:func:`replay.physical.measure.measure_interleaved`), with
    the placement control in every block, and the disk probed after each repetition."""
    from replay.physical.calibrate import probe_rate
    from replay.physical.measure import Arm, measure_interleaved
    from replay.physical.stalltrace import report

    methods = list(o.layouts)
    probe_file, probe_size = probe
    out = Measured({(m, pf, frac): [] for pf, frac in cells_of(o) for m in methods}, {frac: [] for frac in o.ram}, [],
                   [probe_rate(probe_file, probe_size, o.workers)] if probe_file else [])
    n_runs = len(cells_of(o)) * len(o.layouts) + len(o.ram)
    bar = progress_bar(total=reps * n_runs * len(fw), desc="validate: measured steps", unit="step", enabled=progress)
    try:
        block_runs = [(m, pf) for m in methods for pf in o.prefetch]
        for rep in range(reps):
            for bi, frac in enumerate(o.ram):
                block = measurement_order(block_runs, rep, bi)
                arms = []
                for m, pf in block:
                    run_id = f"{m}-ram{frac:g}-{pf}-rep{rep}"
                    arms.append(Arm(Container.open(r.lay.dirs[m]), r.config(pf, frac), run_dir / f"{run_id}.jsonl",
                                    run_id=run_id, coupling=r.coupling))
                run_id = f"{PLACEMENT_COPY}-ram{frac:g}-{control_pf}-rep{rep}"
                arms.append(Arm(Container.open(r.lay.dirs[PLACEMENT_COPY]), r.config(control_pf, frac),
                                run_dir / f"{run_id}.jsonl", run_id=run_id))
                results = measure_interleaved(arms, r.trace, r.mask, progress=False, on_step=lambda: bar.update(1))
                copy_arm, copy_res = arms.pop(), results.pop()
                out.control[frac].append(copy_res.stall_ns / 1e9 / max(copy_res.committed, 1))
                if not o.keep:
                    copy_arm.out.unlink()
                for (m, pf), arm, res in zip(block, arms, results):
                    out.order.append(((m, pf, frac), rep, (rep, bi)))
                    run = report([arm.out]).runs[0]
                    stall, committed = step_order(run, fw, str(arm.out))
                    out.runs[(m, pf, frac)].append(_run_figures(run, res, stall, committed))
                    if not o.keep:
                        arm.out.unlink()
            if probe_file:
                out.rates.append(probe_rate(probe_file, probe_size, o.workers, seed=rep + 1))
    finally:
        bar.close()
    return out


def merge_after_sentence(merge: tuple[str, float | None], after: dict) -> tuple[str, float | None]:
    """The calibration's merge sentence (:func:`relayout.render.measurements.merge_sentence`) with what merging
    saved again after the measurement (:func:`replay.physical.calibrate.merge_saving`): how far the per-read
    cost a coalescing saving rests on moved while the runs were measured."""
    us = 1e6
    return (merge[0] + f"; after the measurement it saved {after['saving_seconds'] * us:.0f} us "
            f"[{after['saving_low_seconds'] * us:.0f}, {after['saving_high_seconds'] * us:.0f}]"), merge[1]


def _diagnoses(r: Replayer, device, measured: Measured, predicted: dict, probe: tuple, workers: int) -> dict:
    """Each run replayed under its own conditions (:mod:`.diagnoses`): the disk's drift and each
    repetition at its probed speed, each run at its drive's speed, at its neighbours' speed, and
    at its drive's speed with the compute its harness ran."""
    keys = list(measured.runs)
    drift, probed = None, {}
    if probe[0]:
        drift = probed_drift(probe[0], probe[1], workers, measured.rates, device)
        probed = {k: [r.stall_and_rate(k, device.scaled(f))[0] for f in drift["scales"]] for k in keys}
    at_run = {k: [at_run_speed(partial(r.stall_and_rate, k), device, x["drive_rate_Bps"]) for x in measured.runs[k]]
              for k in keys}
    near = neighbour_scales([at_run[k][i]["scale"] if at_run[k][i] else None for k, i, _ in measured.order],
                            [g for _, _, g in measured.order])
    at_near = {k: [None] * len(measured.runs[k]) for k in keys}
    for (k, i, _), f in zip(measured.order, near):
        if f is not None:
            at_near[k][i] = {"scale": f, "predicted_stall_per_token_s": r.stall_and_rate(k, device.scaled(f))[0]}
    at_harness = {}                              # each run at its own drive's speed and with its own compute
    for k in keys:
        rate = r.runtime.compute_bytes_per_second
        compute = predicted[k].summary.compute_per_token_s
        matmul = r.stall_at_compute(k, device.scaled(1.0), rate / 2)[1] - compute   # compute is dense + matmul bytes / rate
        at_harness[k] = []
        for run, a in zip(measured.runs[k], at_run[k]):
            x = None if a is None else at_harness_compute(
                lambda q, k=k, f=a["scale"]: r.stall_at_compute(k, device.scaled(f), q)[0], rate, compute, matmul,
                run["compute_s"])
            at_harness[k].append(None if x is None else {**x, "scale": a["scale"]})
    return {"drift": drift, "probed": probed, "at_run": at_run, "at_near": at_near, "at_harness": at_harness}


def _run_size(o: ValidateOptions, everything: Replayer, device, *, started: float, notify) -> tuple[int, int, str | None]:
    """``(tokens, reps, what was chosen and why)``: as given (or the defaults), or what ``--minutes``
    affords (:func:`.options.choose_size`) after a probe of stock's first steps at the smallest
    RAM budget (the slowest cell), counted from ``started`` (``time.perf_counter()``)."""
    from replay.model.engine import simulate
    from replay.physical.measure import measure

    available = int(everything.mask.sum())
    tokens = min(o.tokens or DEFAULT_TOKENS, available)
    reps = o.reps or DEFAULT_REPS
    if o.minutes is None:
        return tokens, reps, None
    n_runs = len(cells_of(o)) * len(o.layouts) + len(o.ram)          # + the placement control in every block
    pf, frac = min(cells_of(o), key=lambda c: c[1])
    probe_steps = min(PROBE_TOKENS, available)
    probing = everything.first(probe_steps)
    # the replay model compiles on a machine's first run: do it now, so the budget counts it
    simulate(probing.trace, probing.mask, probing.lay.layouts["stock"], device, probing.config(pf, frac),
             coupling=probing.coupling)
    notify(f"probing: {probe_steps} steps of stock at RAM {frac:g}, prefetch {pf}")
    res = measure(Container.open(probing.lay.dirs["stock"]), probing.trace, probing.mask, probing.config(pf, frac), None,
                  record=False, progress=False, coupling=probing.coupling)
    budget = o.minutes * 60 - (time.perf_counter() - started)
    budget -= max(15.0, 0.1 * budget)       # predictions, evidence, writing, removing the work directory
    tokens, reps, chosen = choose_size(o, available, n_runs, res.wall_seconds, probe_steps, budget)
    notify(chosen)
    return tokens, reps, chosen


def validate(o: ValidateOptions, notify=print, progress: bool = True) -> dict:
    """Run the validation and write its record to ``o.output``.

    Parameters
    ----------
    o : what to do (:class:`.options.ValidateOptions`), checked first (:func:`.options.check_options`).
    notify : called with each line of progress said to the user.
    progress : show progress bars.

    Returns
    -------
    The ``validation.json`` record written (:meth:`.record.ValidationRecord.to_json`).
    """
    from replay.evaluation.gate import evaluation_forwards, training_coupling
    from replay.physical.calibrate import merge_saving

    t_start = time.perf_counter()
    check_options(o)
    given = None
    if o.device:
        from replay.model.device import load_device

        given = Calibrated(load_device(o.device), f"given: {o.device}")
    work = WorkDir.open(o.path / WORK_NAME, WORK_MARKER, "validate")
    try:
        src, manifest, trace, lay, synthetic = prepare(o, work, notify)
        first_read = read_each_once(lay.dirs, progress)
        cal = given or _calibrated(o, lay, notify)
        device = cal.device
        mask_all, held = evaluation_forwards(trace, list(lay.plans.values()))
        available = int(mask_all.sum())
        stock_plan = lay.plans["stock"]
        layers = set(trace.layers.tolist())
        ebytes = stock_plan.stock.expert_bytes()
        routed = int(sum(ebytes[li].sum() for li, l in enumerate(stock_plan.stock.layers) if l in layers))
        coupling = training_coupling(trace, stock_plan) if "coupled" in o.prefetch else None
        base_cfg = RuntimeConfig(workers=o.workers, coalesce=o.coalesce)
        cells = cells_of(o)
        control_pf = "none" if "none" in o.prefetch else o.prefetch[0]   # the placement control's prefetch source
        everything = Replayer(trace, mask_all, lay, base_cfg, routed, coupling)
        run_dir = make_dirs(work.claim("runs"))
        tokens, reps, chosen = _run_size(o, everything, device, started=t_start, notify=notify)
        if reps % 2:
            notify(f"{reps} repetitions: the last is unpaired, so a disk whose speed drifts through a round is not "
                   "fully counterbalanced (an even --reps is)")
        if o.tokens is not None and o.tokens > available:
            notify(f"only {available} held-out steps in the trace: measuring {available}, not {o.tokens}")
        r = everything.first(tokens)
        fw = np.flatnonzero(r.mask)
        methods = list(o.layouts)
        probe = probe_target(lay.dirs["stock"], lay.layouts["stock"])
        # predictions: exactly the measured steps, on the profile
        predicted = {(m, pf, frac): r.predict((m, pf, frac), device) for pf, frac in cells for m in methods}
        measured = _measure(o, r, fw=fw, reps=reps, control_pf=control_pf, run_dir=run_dir, probe=probe,
                            progress=progress)
        merge, merge_after = cal.merge, None
        merge_size = cal.profile["calibration"]["merge"]["size"] if merge else 0
        if merge and probe[0] and probe[0].stat().st_size >= 2 * merge_size + 4096:
            merge_after = merge_saving(probe[0], merge_size)  # what merging saves now, beside what it saved before
            merge = merge_after_sentence(merge, merge_after)
        record = build_record(Measurement(
            options=o, device=device, device_source=cal.source, profile_path=cal.path, source=src, manifest=manifest,
            trace=trace, held=held, plans=lay.plans, synthetic=synthetic, routed=routed, runtime=base_cfg, reps=reps,
            chosen=chosen, cells=cells, methods=methods, forwards=fw, predicted=predicted, measured=measured.runs,
            first_read=first_read, sharing=cal.sharing, merge=merge, merge_after=merge_after,
            control_prefetch=control_pf, control=measured.control,
            **_diagnoses(r, device, measured, predicted, probe, o.workers)))
        record = replace(record, work_dir=str(work.path) if o.keep else None)
        record = replace(record, plots=[str(p) for p in write_validation_plot(record.to_json(), o.plots)]
                         if o.plots is not None else [])
        out = replace(record, elapsed_seconds=round(time.perf_counter() - t_start, 3)).to_json()
        write_json_atomic(o.output, out)
        return out
    finally:
        if o.keep:
            work.seal()
        else:
            for line in work.remove():
                notify(line)
