"""The gate record file (``gate.json``): reading, validation, and the recheck of its verdict.

:mod:`replay.gate` writes the record; a rewrite reads it to decide whether it may run, and
``relayout gate --recheck`` recomputes its interval and verdict from the evidence it stores
(:mod:`replay.evidence`). Nothing here loads the replay model.
"""

from __future__ import annotations

import numpy as np

from containers.errors import InputError
from containers.jsonfile import read_document

from .evidence import Evidence, judge

GATE_FORMAT = "relayout.gate"
VERDICTS = ("pass", "fail", "insufficient")


def load_gate(path) -> dict:
    g = read_document(path, GATE_FORMAT, 1, ("verdict", "plan", "reason"), "gate record")
    if g["verdict"] not in VERDICTS:
        raise InputError(path, "gate record has no verdict")
    plan = g["plan"]
    if not isinstance(plan, dict) or not isinstance(plan.get("digest"), str) \
            or not isinstance(plan.get("source_fingerprint"), (str, type(None))) or not isinstance(g["reason"], str):
        raise InputError(path, "gate record is malformed (plan digest, source fingerprint and reason must be strings)")
    return g


def recheck(gate: dict, where: str) -> list[str]:
    """Recompute a gate record's interval and verdict from its stored evidence; the differences.

    Empty when the record is consistent: same interval (the bootstrap is deterministic given the
    stored seed and resample count) and same verdict for the stored threshold.
    """
    try:
        ev_json = gate["evidence"]
        need = float(gate["threshold"]["seconds_per_token"])
        min_sessions = int(ev_json["min_sessions"])
        stored = gate["saving_per_token_s"]
        stored_interval = (float(stored["estimate"]), float(stored["low"]), float(stored["high"]))
        stored_verdict = gate["verdict"]
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(where, f"gate record cannot be rechecked (lacks {exc}; made by an older relayout?)") from None
    ev = Evidence.from_json(ev_json, where)
    got = ev.interval()
    verdict = judge(ev, need, min_sessions).verdict
    problems = []
    if not np.allclose(got, stored_interval, rtol=1e-9, atol=1e-15):
        problems.append(f"interval recomputed from the units is {got[0]:.6g} [{got[1]:.6g}, {got[2]:.6g}] s/token, the record says "
                        f"{stored_interval[0]:.6g} [{stored_interval[1]:.6g}, {stored_interval[2]:.6g}]")
    if verdict != stored_verdict:
        problems.append(f"verdict recomputed is {verdict!r}, the record says {stored_verdict!r}")
    return problems
