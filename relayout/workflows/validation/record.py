"""The ``validation.json`` record: its typed form, how a run's measurements become one, and its judging.

:class:`ValidationRecord` is the document ``relayout validate`` writes (format
:data:`VALIDATION_FORMAT`, version :data:`VALIDATION_VERSION`), read back strictly
(:meth:`ValidationRecord.from_json`: a record of another version is refused in one line, with the
advice to run ``relayout validate`` again). :class:`Measurement` is what one run measured and
predicted, built by keyword; :func:`build_record` words it into the record's cells, layout and
prefetch comparisons and placement control, and :func:`judge` adds each judgement and the
``summary`` (:mod:`.summary`): a pure function of the measurements and predictions the record
holds. S, savings and TPOT in seconds per committed token (``_s``), sizes in bytes, RAM budgets
as fractions of the routed bytes of the traced layers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from containers import __version__
from containers import records
from containers.errors import InputError
from replay.evaluation.evidence import HeldOut
from replay.model.routing import RoutingTrace
from replay.model.config import RuntimeConfig
from replay.model.device import ArrayProfile

from .diagnoses import normalized_saving, predicted_at, run_page_cache_waits, run_stalls, saving
from .options import TRAIN_FRACTION, ValidateOptions
from .rules import (DIAGNOSES, GATE_THRESHOLD, PREFETCH_TOLERANCE, TOLERANCE, cell_agreement, judge_saving,
                    over_repetitions, placement_bound, placement_difference)
from .summary import summarize_validation

VALIDATION_FORMAT = "relayout.validation"
VALIDATION_VERSION = 12


@dataclass(frozen=True)
class ValidationRecord:
    """``validation.json``: what was measured and predicted, on what, and how it was judged.

    ``device``: the profile predicted on (name, digest, source, saved path, the profile);
    ``container``, ``trace``, ``layouts``: what was measured; ``config``: how (tokens,
    repetitions, RAM budgets, prefetch sources, runtime); ``drift``: the disk's probed rates
    (None when it could not be probed); ``first_read``: each container's read-once rate;
    ``cells``, ``comparisons``, ``prefetch_comparisons``: each judged (:func:`judge`);
    ``placement_control``: stock against its byte-identical copy per RAM budget;
    ``calibration_sharing``/``calibration_merge``: the calibration's sentences (None with a
    given profile); ``summary``: the verdict (None until judged); ``work_dir`` (kept with
    ``--keep``), ``plots`` and ``elapsed_seconds`` (s), set once the run is done.
    """

    format: str
    version: int
    tool_version: str
    path: str
    device: dict[str, Any]
    container: dict[str, Any]
    trace: dict[str, Any]
    layouts: dict[str, Any]
    config: dict[str, Any]
    drift: dict[str, Any] | None
    first_read: dict[str, Any]
    cells: list[dict[str, Any]]
    comparisons: list[dict[str, Any]]
    prefetch_comparisons: list[dict[str, Any]]
    placement_control: dict[str, Any]
    calibration_sharing: dict[str, Any] | None
    calibration_merge: dict[str, Any] | None
    summary: dict[str, Any] | None = None
    work_dir: str | None = None
    plots: list[str] | None = None
    elapsed_seconds: float | None = None

    def to_json(self) -> dict:
        return records.to_json(self)

    @classmethod
    def from_json(cls, obj, where: str | None = None) -> "ValidationRecord":
        """The record in ``obj`` (parsed JSON); one :class:`InputError` for another format, another
        version (run ``relayout validate`` again) or a missing or mistyped field."""
        if not isinstance(obj, dict) or obj.get("format") != VALIDATION_FORMAT:
            got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise InputError(where, f"not a {VALIDATION_FORMAT} record (format {got!r})")
        if obj.get("version") != VALIDATION_VERSION:
            raise InputError(where, f"a {VALIDATION_FORMAT} record of version {obj.get('version')!r}; this relayout reads "
                                    f"version {VALIDATION_VERSION}: run relayout validate again")
        return records.from_json(cls, obj, where, "validation record")


@dataclass(frozen=True)
class Measurement:
    """What one validation run measured and predicted, as :func:`build_record` words it.

    ``cells``: the (prefetch source, RAM fraction) pairs in the record's order; ``methods``: the
    layouts. Keyed by ``(layout, prefetch, RAM fraction)``: ``predicted`` (a
    :class:`.run.Prediction` each), ``measured`` (per repetition a dict of the run's per-step
    stall (s) and committed tokens, wall time, TPOT, compute, recall, cache state, drive rate,
    page-cache waits and drive reads), ``probed`` (S per repetition at its probed speed),
    ``at_run``, ``at_near``, ``at_harness`` (per repetition, the diagnoses of
    :mod:`.diagnoses`). ``control``: per RAM fraction, S of the stock copy per repetition,
    measured with prefetch ``control_prefetch``.
    """

    options: ValidateOptions
    device: ArrayProfile
    device_source: str
    profile_path: Path | None
    source: Path
    manifest: dict
    trace: RoutingTrace
    held: HeldOut
    plans: dict
    synthetic: bool
    routed: int
    runtime: RuntimeConfig
    reps: int
    chosen: str | None
    cells: list
    methods: list
    forwards: np.ndarray
    predicted: dict
    measured: dict
    drift: dict | None
    probed: dict
    first_read: dict
    at_run: dict
    at_near: dict
    at_harness: dict
    sharing: tuple | None
    merge: tuple | None
    merge_after: dict | None
    control_prefetch: str
    control: dict


def _normalized(m: Measurement, base: tuple, new: tuple) -> dict:
    """A saving of ``new`` over ``base`` with each run brought to the model's conditions: at its
    drive's speed, with its harness's compute too, and at its speed less its page-cache waits."""
    def side(key: tuple, at: dict) -> tuple:
        return run_stalls(m.measured[key]), m.predicted[key].summary.stall_per_token_s, at[key]

    def less_cache_waits(key: tuple, waits: list[float]) -> tuple:
        return ([s - w for s, w in zip(run_stalls(m.measured[key]), waits)],
                m.predicted[key].summary.stall_per_token_s, m.at_run[key])

    waits = run_page_cache_waits(m.measured[base]), run_page_cache_waits(m.measured[new])
    return {"at_run_speed": normalized_saving(side(base, m.at_run), side(new, m.at_run)),
            "at_harness_compute": normalized_saving(side(base, m.at_harness), side(new, m.at_harness)),
            "less_page_cache_waits": None if None in waits else
            normalized_saving(less_cache_waits(base, waits[0]), less_cache_waits(new, waits[1]))}


def _mean_and_each(values: list) -> dict:
    return {"mean": float(np.mean(values)), "repetitions": values}


def cell_row(m: Measurement, key: tuple) -> dict:
    """One cell of the record: predicted and measured S, TPOT, compute, drive reads and the diagnoses."""
    method, pf, frac = key
    summ = m.predicted[key].summary
    runs = m.measured[key]
    each = run_stalls(runs)
    iv = over_repetitions(each)
    mean = iv["estimate_s"]
    pred = summ.stall_per_token_s
    adjusted = None
    if m.drift is not None:
        each_pred = m.probed[key]
        adjusted = {"predicted_stall_per_token_s": each_pred, "ratio": float(np.mean(each_pred)) / mean if mean > 0 else None}
    run_speed, near_speed, harness = (predicted_at(x[key], mean) for x in (m.at_run, m.at_near, m.at_harness))
    waits = run_page_cache_waits(runs)
    recall = None
    if pf != "none":
        recall = {"predicted": summ.prefetch.timely_required_byte_recall if summ.prefetch else None,
                  "measured": [r["recall"] for r in runs]}
    return {
        "layout": method, "ram_fraction": frac, "ram_bytes": int(m.routed * frac), "prefetch": pf,
        "predicted_stall_per_token_s": pred,
        "predicted_oracle_stall_per_token_s": summ.oracle_stall_per_token_s,
        "predicted_tpot_s": summ.tpot_s,
        "measured_stall_per_token_s": {"mean": mean, "repetitions": each, "low": iv["low_s"], "high": iv["high_s"],
                                       "interval": iv["method"]},
        "measured_tpot_s": _mean_and_each([r["tpot_s"] for r in runs]),
        "predicted_compute_per_token_s": summ.compute_per_token_s,
        "measured_compute_per_token_s": _mean_and_each([r["compute_s"] for r in runs]),
        "measured_wall_seconds": [r["wall_s"] for r in runs],
        "measured_page_cache_wait_per_token_s": None if waits is None else _mean_and_each(waits),
        "predicted_drive_reads_per_token": m.predicted[key].drive_reads_per_token,
        "measured_drive_reads_per_token": None if any(r["drive_reads_per_token"] is None or not r["direct"]
                                                      for r in runs) else
        _mean_and_each([r["drive_reads_per_token"] for r in runs]),
        "ratio": pred / mean if mean > 0 else None,
        "at_probed_speed": adjusted,
        "at_run_speed": run_speed,
        "at_neighbour_speed": near_speed,
        "at_harness_compute": harness,
        "timely_required_byte_recall": recall,
    }


def comparison_row(m: Measurement, base: tuple, new: tuple) -> dict:
    """A layout's saving over stock (same RAM budget and prefetch source), predicted and
    measured, with the gate's decision on each."""
    method, pf, frac = new
    base_runs = m.measured[base]
    x = saving(m.predicted[base].steps, m.predicted[new].steps, base_runs, m.measured[new])
    p, mm = x["predicted_saving"], x["measured_saving"]
    x.update(_normalized(m, base, new))
    tpot_p = m.predicted[base].summary.tpot_s
    tpot_m = float(np.mean([r["tpot_s"] for r in base_runs]))
    gate_p = p["low_s"] >= GATE_THRESHOLD * tpot_p
    gate_m = mm["low_s"] >= GATE_THRESHOLD * tpot_m
    return {"layout": method, "baseline": "stock", "ram_fraction": frac, "prefetch": pf, **x,
            "gate": {"threshold": GATE_THRESHOLD,
                     "predicted": {"tpot_s": tpot_p, "need_s": GATE_THRESHOLD * tpot_p, "passes": bool(gate_p)},
                     "measured": {"tpot_s": tpot_m, "need_s": GATE_THRESHOLD * tpot_m, "passes": bool(gate_m)},
                     "same_decision": bool(gate_p == gate_m)}}


def prefetch_row(m: Measurement, base: tuple, new: tuple) -> dict:
    """A prefetch source's saving over no prefetch (same layout and RAM budget): the plain saving
    over repetitions (no layer of a forward is beyond a prefetch source's reach to serve as a
    drift control: the runtime queues layer L+1's loads when L is routed, the first's too)."""
    method, pf, frac = new
    x = saving(m.predicted[base].steps, m.predicted[new].steps, m.measured[base], m.measured[new])
    x.update(_normalized(m, base, new))
    return {"layout": method, "ram_fraction": frac, "prefetch": pf, "baseline": "none", "tolerance": PREFETCH_TOLERANCE, **x}


def build_record(m: Measurement) -> ValidationRecord:
    """The judged record of one run (:func:`judge`), ``work_dir``, ``plots`` and ``elapsed_seconds`` unset.

    Parameters
    ----------
    m : what the run measured and predicted.

    Returns
    -------
    The :class:`ValidationRecord`, with its judgements and summary.
    """
    o, trace, fw = m.options, m.trace, m.forwards
    cells = [cell_row(m, (method, pf, frac)) for pf, frac in m.cells for method in m.methods]
    comparisons = [comparison_row(m, ("stock", pf, frac), (method, pf, frac))
                   for pf, frac in m.cells for method in m.methods if method != "stock"]
    prefetch = []
    if "none" in o.prefetch:
        prefetch = [prefetch_row(m, (method, "none", frac), (method, pf, frac))
                    for pf, frac in m.cells if pf != "none" for method in m.methods]
    placement = {"prefetch": m.control_prefetch, "blocks": [
        placement_difference(frac, run_stalls(m.measured[("stock", m.control_prefetch, frac)]), copy_s)
        for frac, copy_s in m.control.items()]}
    cold = sorted({r["cold"] for runs in m.measured.values() for r in runs})
    device = m.device
    return judge(ValidationRecord(
        format=VALIDATION_FORMAT,
        version=VALIDATION_VERSION,
        tool_version=__version__,
        path=str(o.path),
        device={"name": device.name, "digest": device.digest(), "source": m.device_source,
                "profile_path": str(m.profile_path) if m.profile_path else None, "profile": device.to_json()},
        container={"path": str(m.source), "synthetic": m.synthetic, "fingerprint": m.manifest["fingerprint"],
                   "content_fingerprint": m.manifest["content_fingerprint"], "routed_bytes": m.routed,
                   "layers": [int(x) for x in trace.layers.tolist()], "experts": int(trace.n_experts),
                   "gb_requested": o.gb if m.synthetic else None},
        trace={"synthetic": True, "fingerprint": trace.fingerprint(), "sessions": len(trace.sessions),
               "train_fraction": TRAIN_FRACTION, "held_out_sessions": [trace.sessions[i] for i in m.held.evaluated],
               "steps": len(fw), "first_forward": int(fw[0]), "last_forward": int(fw[-1]),
               "committed_tokens": int(trace.fwd_committed[fw].sum())},
        layouts={method: {"plan_digest": p.digest, "method": p.method,
                          "container": "the source" if method == "stock" and not m.synthetic else "rewritten copy"}
                 for method, p in m.plans.items()},
        config={"tokens": len(fw), "reps": m.reps, "layouts": list(m.methods), "ram_fractions": list(o.ram),
                "prefetch": list(o.prefetch), "workers": o.workers, "minutes": o.minutes, "chosen": m.chosen,
                "runtime": m.runtime.to_json(), "gate_threshold": GATE_THRESHOLD, "tolerance": TOLERANCE,
                "cache": cold, "seed": o.seed},
        drift=m.drift,
        first_read=m.first_read,
        cells=cells,
        comparisons=comparisons,
        prefetch_comparisons=prefetch,
        placement_control=placement,
        calibration_sharing=None if m.sharing is None else {"sentence": m.sharing[0], "shares": m.sharing[1]},
        calibration_merge=None if m.merge is None else {"sentence": m.merge[0], "predicted_over_measured": m.merge[1],
                                                        "after_measurement": m.merge_after},
    ))


def judge(record: ValidationRecord) -> ValidationRecord:
    """The record judged: each cell's and each saving's family interval
    (:func:`.rules.over_repetitions`) and agreement (:func:`.rules.cell_agreement`,
    :func:`.rules.judge_saving`; a layout's saving against the placement control of its RAM
    budget, :func:`.rules.placement_bound`), each saving at equal disk speed, at equal disk speed
    and compute, and less the page-cache waits, judged the same way, and the ``summary``
    (:func:`.summary.summarize_validation`). A pure function of the measurements and predictions
    the record holds; ``record`` itself is left as it was."""
    cells = copy.deepcopy(record.cells)
    comparisons = copy.deepcopy(record.comparisons)
    prefetch = copy.deepcopy(record.prefetch_comparisons)
    k = len(cells) + len(comparisons) + len(prefetch)     # the judgements the verdict rests on
    control = record.placement_control["blocks"]

    def family(m: dict) -> dict:
        return {**m, "family": over_repetitions(m["repetitions"], k)["family"]}

    for c in cells:
        m = c["measured_stall_per_token_s"] = family(c["measured_stall_per_token_s"])
        c["agreement"] = cell_agreement(c["predicted_stall_per_token_s"], m["mean"], m["family"]["low_s"],
                                        m["family"]["high_s"])
    for x, tolerance, bound in [
            *((x, None, placement_bound([b for b in control if b["ram_fraction"] == x["ram_fraction"]] or control))
              for x in comparisons),
            *((x, PREFETCH_TOLERANCE, None) for x in prefetch)]:
        predicted = x["predicted_saving"]["estimate_s"]
        x["measured_saving"] = family(x["measured_saving"])
        x.update(judge_saving(predicted, x["measured_saving"], tolerance, bound))
        for at in DIAGNOSES:                                 # each run under the model's conditions: no placement left
            if x[at]:
                m = family(x[at]["measured"])
                x[at] = {"measured": m, **judge_saving(predicted, m, tolerance)}
    sharing, merge = record.calibration_sharing, record.calibration_merge
    summary = summarize_validation(cells, comparisons, None if record.drift is None else record.drift["change"],
                                   prefetch, record.first_read,
                                   None if sharing is None else (sharing["sentence"], sharing["shares"]), control,
                                   None if merge is None else (merge["sentence"], merge["predicted_over_measured"]))
    return replace(record, cells=cells, comparisons=comparisons, prefetch_comparisons=prefetch, summary=summary)


def judge_record(obj: dict, where: str | None = None) -> dict:
    """A ``validation.json`` document judged again by the present rules.

    Parameters
    ----------
    obj : the parsed document (:meth:`ValidationRecord.from_json`: of the present version only);
        left as it was.
    where : the file it came from, named in a one-line :class:`InputError`.

    Returns
    -------
    The judged record (:func:`judge`) as JSON values, in the order ``validate`` writes them.
    """
    return judge(ValidationRecord.from_json(obj, where)).to_json()
