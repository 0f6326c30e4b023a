"""Paired replay of two layouts on held-out sessions, the oracle bound, and the rewrite gate.

The gate passes only when the lower end of the 95% interval of predicted stall saved per
committed token is at least ``threshold`` x the baseline's predicted TPOT, on sessions the plan
did not learn from, for the chosen device profile and runtime configuration. Its record,
``gate.json``, holds everything needed to audit the decision.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from containers import __version__
from containers.errors import InputError
from containers.jsonfile import read_document
from containers.layout import Layout

from .config import RuntimeConfig, pinned_experts
from .device import ArrayProfile
from .engine import simulate, split_state
from .metrics import session_sums, step_table, summarize
from .planfile import Plan
from .prefetch import coupling_table
from .stats import paired_saving, step_blocks
from .trace import FORWARD_KINDS, RoutingTrace

GATE_FORMAT = "relayout.gate"
DEFAULT_THRESHOLD = 0.05


def evaluation_forwards(trace: RoutingTrace, excluded_sessions: set[str]) -> tuple[np.ndarray, list[int]]:
    """Decode and verify forwards of the sessions not in ``excluded_sessions`` (held-out discipline)."""
    keep = [i for i, s in enumerate(trace.sessions) if s not in excluded_sessions]
    if not keep:
        raise InputError(trace.source or None, "every session of this trace was used to train the plan; "
                         "replay needs held-out sessions (record more, or plan with a smaller --train-fraction)")
    mask = trace.session_forward_mask(keep) & (trace.fwd_kind != FORWARD_KINDS.index("prefill"))
    if not mask.any():
        raise InputError(trace.source or None, "held-out sessions contain no decode steps")
    return mask, keep


def check_trace_matches(trace: RoutingTrace, plan: Plan) -> None:
    trace.require_rows("replay")
    g = plan.geometry
    if trace.n_experts > g["n_experts"]:
        raise InputError(trace.source or None, f"trace has expert ids up to {trace.n_experts - 1}; the plan's model has {g['n_experts']} per layer")
    extra = sorted(set(trace.layers.tolist()) - set(g["routed_layers"]))
    if extra:
        raise InputError(trace.source or None, f"trace routes layers {extra[:5]} the plan does not cover")


@dataclass
class LayoutRun:
    name: str
    steps: object
    summary: dict
    sessions: dict


def run_layout(name: str, trace: RoutingTrace, mask: np.ndarray, layout: Layout, device: ArrayProfile,
               config: RuntimeConfig, pinned: np.ndarray, split=None, coupling=None) -> LayoutRun:
    inst, usage = simulate(trace, mask, layout, device, config, pinned, split, coupling)
    steps = step_table(trace, mask, inst)
    return LayoutRun(name, steps, summarize(steps, usage, config.other_seconds_per_token), session_sums(steps, len(trace.sessions)))


def _training_forwards(trace: RoutingTrace, plan: Plan, what: str) -> np.ndarray:
    train = [i for i, s in enumerate(trace.sessions) if s in set(plan.training_sessions)]
    if not train:
        raise InputError(trace.source or None, f"{what} needs the plan's training sessions in the trace")
    return trace.session_forward_mask(train)


def training_coupling(trace: RoutingTrace, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """The coupled prefetch source's table, learned from the plan's training sessions."""
    return coupling_table(trace, _training_forwards(trace, plan, "the coupled prefetch source (its pair table)"), plan.layout)


def _pins(trace: RoutingTrace, plan: Plan, config: RuntimeConfig) -> np.ndarray:
    L, E = len(plan.layout.layers), plan.layout.n_experts
    if config.pin_bytes <= 0:
        return np.zeros((L, E), dtype=bool)
    fm = _training_forwards(trace, plan, "pinning (to rank experts by heat)")
    heat = np.zeros((L, E))
    for li, layer in enumerate(plan.layout.layers):
        rows = trace.experts[trace.layer_rows(layer, fm)]
        heat[li] = np.bincount(rows[rows >= 0].astype(np.int64), minlength=E)[:E]
    return pinned_experts(heat, plan.layout.expert_bytes()[:, 0], config.pin_bytes)


def compare(plan: Plan, trace: RoutingTrace, device: ArrayProfile, config: RuntimeConfig,
            baseline: Plan | None = None, threshold: float = DEFAULT_THRESHOLD, seed: int = 0) -> dict:
    """Replay baseline (stock, or another plan's layout) and the plan; gate; return gate.json."""
    check_trace_matches(trace, plan)
    if baseline is not None and baseline.raw["source"]["fingerprint"] != plan.raw["source"]["fingerprint"]:
        raise InputError(baseline.path, "baseline plan is for a different container than the plan")
    excluded = set(plan.training_sessions) | (set(baseline.training_sessions) if baseline else set())
    mask, evaluated = evaluation_forwards(trace, excluded)
    pins = _pins(trace, plan, config)
    split = split_state(plan.split, plan.layout, plan.geometry["moe_intermediate_size"])
    plan_config = config
    if split is not None:
        plan_config = replace(config, ram_bytes=max(0, config.ram_bytes - int(plan.split["ram_bytes"])))
    base_layout = baseline.layout if baseline is not None else plan.stock
    coupling = training_coupling(trace, plan) if config.prefetch == "coupled" else None
    base = run_layout("baseline", trace, mask, base_layout, device, config, pins, coupling=coupling)
    new = run_layout("plan", trace, mask, plan.layout, device, plan_config, pins, split, coupling)

    n_eval = len(evaluated)
    if n_eval >= 2:
        units = np.array(evaluated)
        b, p, a = base.sessions["stall"][units], new.sessions["stall"][units], base.sessions["committed"][units]
        unit = "session"
    else:
        blk = step_blocks(base.steps.session)
        b = np.bincount(blk, weights=base.steps.stall)
        p = np.bincount(blk, weights=new.steps.stall)
        a = np.bincount(blk, weights=base.steps.committed)
        unit = "block of steps (one held-out session only)"
    saving = paired_saving(b, p, a, unit, seed=seed)
    tpot = base.summary["tpot_s"]
    need = threshold * tpot
    headroom = base.summary["stall_per_token_s"] - base.summary["oracle_stall_per_token_s"]
    passed = saving.low >= need
    reason = _reason(passed, saving, tpot, threshold, headroom, base.summary)
    return {
        "format": GATE_FORMAT,
        "version": 1,
        "verdict": "pass" if passed else "fail",
        "reason": reason,
        "tool_version": __version__,
        "plan": {"path": plan.path, "digest": plan.digest, "method": plan.raw["method"],
                 "source_fingerprint": plan.raw["source"]["fingerprint"], "source_kind": plan.raw["source"]["kind"]},
        "baseline": {"kind": "plan", "path": baseline.path, "digest": baseline.digest} if baseline else {"kind": "stock"},
        "trace": {"path": trace.source, "fingerprint": trace.fingerprint(),
                  "sessions_evaluated": [trace.sessions[i] for i in evaluated],
                  "sessions_excluded_as_training": sorted(excluded & set(trace.sessions))},
        "device": {"name": device.name, "digest": device.digest(), "profile": device.to_json()},
        "runtime": config.to_json(),
        "threshold": {"fraction_of_tpot": threshold, "seconds_per_token": need},
        "saving_per_token_s": saving.to_json(),
        "saving_fraction_of_tpot": {"estimate": saving.estimate / tpot, "low": saving.low / tpot, "high": saving.high / tpot},
        "headroom": {"baseline_stall_s": base.summary["stall_per_token_s"], "oracle_stall_s": base.summary["oracle_stall_per_token_s"],
                     "max_saving_s": headroom, "max_saving_fraction_of_tpot": headroom / tpot},
        "baseline_metrics": base.summary,
        "plan_metrics": new.summary,
        "per_session": [
            {"session": trace.sessions[i], "committed": int(base.sessions["committed"][i]),
             "baseline_stall_s": float(base.sessions["stall"][i]), "plan_stall_s": float(new.sessions["stall"][i]),
             "oracle_stall_s": float(base.sessions["oracle"][i])}
            for i in evaluated
        ],
    }


def _reason(passed: bool, s, tpot: float, threshold: float, headroom: float, base: dict) -> str:
    ms = 1e3
    text = (f"predicted saving {s.estimate * ms:.3f} ms/token (95% CI {s.low * ms:.3f} to {s.high * ms:.3f}, over "
            f"{s.n_units} {s.unit}s) = {s.low / tpot:.1%} of baseline TPOT {tpot * ms:.1f} ms at the interval's low end; "
            f"the gate needs {threshold:.0%}.")
    if passed:
        return "PASS: " + text
    if headroom < threshold * tpot:
        return (f"FAIL: {text} No headroom: baseline stall {base['stall_per_token_s'] * ms:.2f} ms/token is within "
                f"{headroom * ms:.2f} ms of the oracle bound ({headroom / tpot:.1%} of TPOT), so no layout can reach the threshold here.")
    return f"FAIL: {text} The bound leaves {headroom / tpot:.1%} of TPOT of headroom, but this layout does not capture enough of it."


def sweep(plan: Plan, trace: RoutingTrace, device: ArrayProfile, config: RuntimeConfig, ram_gb: list[float],
          workers: list[int], threshold: float = DEFAULT_THRESHOLD, baseline: Plan | None = None) -> list[dict]:
    """The regime map (seed H3c): the gate over RAM budgets x workers x coalescing."""
    cells = []
    for ram in ram_gb:
        for w in workers:
            for co in (False, True):
                cfg = replace(config, ram_bytes=int(ram * 1e9), workers=w, coalesce=co, batched=False)
                g = compare(plan, trace, device, cfg, baseline, threshold)
                cells.append({"ram_gb": ram, "workers": w, "coalesce": co, "verdict": g["verdict"],
                              "baseline_stall_s": g["baseline_metrics"]["stall_per_token_s"],
                              "plan_stall_s": g["plan_metrics"]["stall_per_token_s"],
                              "oracle_stall_s": g["headroom"]["oracle_stall_s"],
                              "saving": g["saving_per_token_s"], "saving_fraction_of_tpot": g["saving_fraction_of_tpot"],
                              "tpot_s": g["baseline_metrics"]["tpot_s"]})
    return cells


def load_gate(path) -> dict:
    g = read_document(path, GATE_FORMAT, 1, ("verdict", "plan", "reason"), "gate record")
    if g["verdict"] not in ("pass", "fail"):
        raise InputError(path, "gate record has no verdict")
    plan = g["plan"]
    if not isinstance(plan, dict) or not isinstance(plan.get("digest"), str) \
            or not isinstance(plan.get("source_fingerprint"), (str, type(None))) or not isinstance(g["reason"], str):
        raise InputError(path, "gate record is malformed (plan digest, source fingerprint and reason must be strings)")
    return g
