"""Diagnoses of a validation's runs: each measured run brought to the model's conditions.

A run's prediction at the speed its own drive served it (:func:`at_run_speed`), at the speed of
the runs interleaved with it (:func:`neighbour_scales`), with the compute its harness ran
(:func:`at_harness_compute`), and the disk's probed drift over the repetitions
(:func:`probed_drift`); the measured savings with each run brought to the model's conditions
(:func:`speed_normalized_savings`, :func:`normalized_saving`). These sit beside the verdict,
which rests on the model as calibrated. S in seconds per committed token, rates in bytes/s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from replay.evaluation.evidence import block_evidence

from .rules import evidence_interval, over_repetitions

RUN_SPEED_STEPS = 3
"""Fixed-point steps of :func:`at_run_speed` (each brings the modelled rate within a few tenths of
a percent of the measured one here; three leave it well inside the 1% the figures are printed to)."""


def at_run_speed(stall_and_rate, device, measured_rate: float | None) -> dict | None:
    """The prediction of one measured run at the speed its disk ran at.

    The measured run's drive served ``measured_rate`` bytes/s while busy
    (:func:`replay.physical.stalltrace.drive_busy`); the model, replaying the same steps on ``device``,
    serves its reads at the rate :func:`replay.model.metrics.drive_rate` gives. The device is scaled
    (:meth:`replay.model.device.ArrayProfile.scaled`) until the two rates agree:
    ``f <- f * measured / modelled(f)`` from ``f = 1``, :data:`RUN_SPEED_STEPS` times.
    ``stall_and_rate(device)`` replays and returns ``(S in s/token, modelled rate)``.

    What it tests: with the disk's speed during the run taken from the run itself, the
    prediction no longer depends on forecasting a drifting disk; it still depends on the
    model's read path, queueing and overlap of compute with reads. It is not what the gate
    uses (the gate has only the calibrated profile). Returns ``{"scale", "predicted_stall_per_token_s",
    "measured_rate_Bps", "modelled_rate_Bps"}``, or None when either rate is unknown.
    """
    if not measured_rate:
        return None
    f = 1.0
    stall, rate = stall_and_rate(device)
    for _ in range(RUN_SPEED_STEPS):
        if not rate:
            return None
        f *= measured_rate / rate
        stall, rate = stall_and_rate(device.scaled(f))
    return {"scale": f, "predicted_stall_per_token_s": stall, "measured_rate_Bps": measured_rate, "modelled_rate_Bps": rate}


def at_harness_compute(stall_at, rate: float, compute: float, matmul: float, measured_compute: float) -> dict | None:
    """The prediction of one measured run with the compute its harness ran (``validate`` replays
    it at its drive's speed too, :func:`at_run_speed`: the run under its own conditions).

    The harness emulates the runtime's compute (:class:`replay.physical.compute_clock.ComputeClock`); its own
    Python work (routing, submitting reads, records, waking) is taken off the emulated compute
    while it fits in it. A harness that counted the work beyond as compute between a layer's
    reads would overlap them with it and measure less stall, the more so for layouts issuing
    more reads; this one times its waits in the compute model's time
    (:meth:`replay.physical.compute_clock.ComputeClock.waited`), and what excess is left falls
    outside a layer's reads. Here the run's excess, ``measured_compute - compute``, is given to
    the model as slower matmuls, at ``rate * matmul / (matmul + excess)``: a check that the
    excess is small and alike across layouts.

    Parameters
    ----------
    stall_at : ``stall_at(rate)`` replays the run's cell with matmuls at ``rate`` (bytes/s) and
        returns S (s/token); ``validate``'s replays the run's steps at its drive's speed.
    rate : the runtime configuration's ``compute_bytes_per_second`` (bytes/s).
    compute, matmul : the model's compute per committed token and its matmul part (s/token).
    measured_compute : the run's compute per committed token (s/token), from its step records.

    Returns
    -------
    ``{"excess_compute_per_token_s", "predicted_stall_per_token_s"}``, or None when the run
    carries no compute, the model has no matmul to stretch, or the run computed less than the
    model's dense part. Like :func:`at_run_speed`, a diagnosis: it tests the read path and
    queueing under the compute the harness really ran, not the runtime's; the verdict rests on
    the model as configured. An approximation: the harness's excess arises mostly around its
    waits for missing experts, while the model stretches every matmul alike, resident experts'
    too (which run before the layer's waits, beside its reads); and the run's speed is taken as
    :func:`at_run_speed` found it under the model's compute, not fitted again under this one.
    """
    if not measured_compute or matmul <= 0:
        return None
    excess = measured_compute - compute
    if matmul + excess <= 0:
        return None
    return {"excess_compute_per_token_s": excess, "predicted_stall_per_token_s": stall_at(rate * matmul / (matmul + excess))}


def neighbour_scales(scales: list, groups: list) -> list:
    """For each run, the mean of the speed factors (:func:`at_run_speed`'s ``scale``) of the
    other runs of its group (``groups``, one id per run: the runs measured interleaved with it,
    :func:`replay.physical.measure.measure_interleaved`): the disk's speed during a run, read off other
    runs, so a prediction at it is tested on a measurement its speed was not taken from. None
    where no other run of the group has a factor."""
    out = []
    for j, g in enumerate(groups):
        near = [x for i, x in enumerate(scales) if i != j and groups[i] == g and x is not None]
        out.append(float(np.mean(near)) if near else None)
    return out


def probed_drift(probe_file: Path, probe_size: int, depth: int, rates: list[float], device) -> dict:
    """The disk's probed rate before the first repetition and after each (bytes/s), and each
    repetition's speed against the profile's: the mean of the probes around it over the rate the
    profile gives the probe's reads (:meth:`replay.model.device.ArrayProfile.steady_rate`)."""
    from replay.physical.calibrate import PROBE_SECONDS

    profile_rate = device.steady_rate(probe_size, depth)
    scales = [(rates[r] + rates[r + 1]) / 2 / profile_rate for r in range(len(rates) - 1)]
    return {"probe": {"file": str(probe_file), "size_bytes": probe_size, "depth": depth, "seconds": PROBE_SECONDS},
            "rates_Bps": rates, "profile_rate_Bps": profile_rate, "scales": scales,
            "change": max(rates) / min(rates) - 1}


def saving(base_pred, new_pred, base_runs: list[dict], runs: list[dict]) -> dict:
    """Predicted and measured saving of ``new`` over ``base`` (s/token): the prediction paired by
    step (moving-block bootstrap over the held-out steps), the measurement paired by repetition (each
    repetition measures both, interleaved step by step: one unit each)."""
    p = evidence_interval(block_evidence(base_pred.stall, new_pred.stall, base_pred.committed, base_pred.session))
    each = [float((b["stall"].sum() - n["stall"].sum()) / b["committed"].sum()) for b, n in zip(base_runs, runs)]
    return {"predicted_saving": p, "measured_saving": {**over_repetitions(each), "repetitions": each}}


def speed_normalized_savings(base_measured, base_predicted: float, base_at_run, new_measured, new_predicted: float,
                             new_at_run) -> list[float]:
    """Per repetition, the measured saving of ``new`` over ``base`` with each run brought to the
    model's conditions (the profile's speed; with :func:`at_harness_compute`, the model's compute
    too) by the model's own sensitivity to them (s/token).

    Parameters
    ----------
    base_measured, new_measured : per repetition, the run's measured S (s/token).
    base_predicted, new_predicted : S predicted on the profile as calibrated (s/token).
    base_at_run, new_at_run : per repetition, S predicted at the speed the run's drive served it
        (:func:`at_run_speed`).

    Returns
    -------
    ``base_measured * base_predicted / base_at_run - new_measured * new_predicted / new_at_run``
    per repetition. If each run measured ``(1 + e)`` times its prediction at its own speed, this is
    ``base_predicted * (1 + e_base) - new_predicted * (1 + e_new)``: the predicted saving exactly
    when the model errs alike on both layouts, whatever the disk's speed did between the runs.
    What remains in it is the model's error on the saving, plus the runs' noise.
    """
    return [float(b * base_predicted / ba - n * new_predicted / na)
            for b, ba, n, na in zip(base_measured, base_at_run, new_measured, new_at_run)]


def run_stalls(runs: list[dict]) -> list[float]:
    """Each measured run's S (s/token)."""
    return [float(r["stall"].sum() / r["committed"].sum()) for r in runs]


def run_page_cache_waits(runs: list[dict]) -> list[float] | None:
    """Each measured run's stall on experts whose own reads the page cache served (s/token,
    :func:`replay.physical.stalltrace.page_cache_wait`); None when a run's records carry no I/O counts."""
    if any(r.get("page_cache_wait_s") is None for r in runs):
        return None
    return [float(r["page_cache_wait_s"] / r["committed"].sum()) for r in runs]


def normalized_saving(base: tuple, new: tuple) -> dict | None:
    """The measured saving with each run brought to the model's conditions
    (:func:`speed_normalized_savings`) over the repetitions, which :func:`.record.judge_record` judges
    the prediction against: a diagnosis beside the plain comparison, which the verdict rests on.
    ``base``, ``new``: (measured S per repetition, S predicted as configured, per repetition the
    run's own prediction: :func:`at_run_speed` for equal disk speed, :func:`at_harness_compute`
    for the compute the harness ran)."""
    (bm, bp, ba), (nm, npred, na) = base, new
    if not ba or not na or any(x is None or x["predicted_stall_per_token_s"] <= 0 for x in ba + na):
        return None
    each = speed_normalized_savings(bm, bp, [x["predicted_stall_per_token_s"] for x in ba],
                                    nm, npred, [x["predicted_stall_per_token_s"] for x in na])
    return {"measured": {**over_repetitions(each), "repetitions": each}}


def predicted_at(entries: list, measured_mean: float) -> dict | None:
    """A cell's repetitions predicted at other speeds (:func:`at_run_speed`, or the neighbours'
    speed) or with the harness's compute (:func:`at_harness_compute`): the factors or excesses,
    the predictions (s/token), the measured drive rates where known, and the mean prediction over
    the measured mean S. None when a repetition has none."""
    if not entries or any(x is None for x in entries):
        return None
    each = [x["predicted_stall_per_token_s"] for x in entries]
    out = {"predicted_stall_per_token_s": each,
           "ratio": float(np.mean(each)) / measured_mean if measured_mean > 0 else None}
    for key, name in (("scale", "scales"), ("excess_compute_per_token_s", "excess_compute_per_token_s")):
        if key in entries[0]:
            out[name] = [x[key] for x in entries]
    if "measured_rate_Bps" in entries[0]:
        out["measured_rate_Bps"] = [x["measured_rate_Bps"] for x in entries]
    return out


