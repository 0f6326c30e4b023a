"""STALL_TRACE analysis (seed section 4 and Appendix A): from records to S and its diagnosis.

A STALL_TRACE is JSONL (optionally zstd-compressed). *Expert records* are keyed by run, request,
step, layer and expert (and segment); *step records* (``"record": "step"``) carry the committed
and evaluated counts, compute/other/wall time and output-token hashes. Times are monotonic
nanoseconds.

Foreground stall of a (run, request, step, layer) is the measure of the union of the intervals
``[need_ns, ready_ns]`` of its required records that arrived late, so overlapping waits are
never double-counted. ``S = sum of stall / sum of committed tokens``: rejected speculative
positions are charged in the numerator and not counted in the denominator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from containers.atomic import atomic_output, make_dirs
from containers.errors import InputError
from containers.jsonfile import iter_jsonl

from .stats import paired_saving

REQUIRED_EXPERT = ("run_id", "request_id", "step", "layer", "expert_id", "required", "bytes")
TIMED = ("issue_ns", "ready_ns", "need_ns")
REQUIRED_STEP = ("run_id", "request_id", "step", "committed_tokens", "evaluated_positions")


def _int(rec: dict, key: str, where: str, minimum: int = 0) -> int:
    v = rec.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise InputError(where, f"{key!r} must be an integer >= {minimum} (got {v!r})")
    return v


@dataclass
class Run:
    """One run's records, as arrays."""

    run_id: str
    steps: dict = field(default_factory=dict)          # (request, step) -> step record
    keys: list = field(default_factory=list)            # (request, step, layer) per expert record
    expert: list = field(default_factory=list)
    segment: list = field(default_factory=list)
    required: list = field(default_factory=list)
    nbytes: list = field(default_factory=list)
    issue: list = field(default_factory=list)
    ready: list = field(default_factory=list)
    need: list = field(default_factory=list)
    already: list = field(default_factory=list)         # ready before any prediction (RAM at prediction)
    speculative: list = field(default_factory=list)
    used: list = field(default_factory=list)
    order: int = 0


def read_stall_trace(path: str | Path) -> dict[str, Run]:
    """Parse and validate; returns runs by run_id in order of first appearance."""
    path = Path(path)
    runs: dict[str, Run] = {}
    for where, rec in iter_jsonl(path):
        is_step = rec.get("record") == "step"
        for key in REQUIRED_STEP if is_step else REQUIRED_EXPERT:
            if key not in rec:
                raise InputError(where, f"missing required field {key!r}")
        run = runs.setdefault(str(rec["run_id"]), Run(str(rec["run_id"]), order=len(runs)))
        request, step = str(rec["request_id"]), _int(rec, "step", where)
        if is_step:
            committed = _int(rec, "committed_tokens", where)
            evaluated = _int(rec, "evaluated_positions", where, 1)
            if committed > evaluated:
                raise InputError(where, "committed_tokens exceeds evaluated_positions")
            if (request, step) in run.steps:
                raise InputError(where, f"second step record for request {request} step {step}")
            run.steps[(request, step)] = rec
            continue
        layer, expert = _int(rec, "layer", where), _int(rec, "expert_id", where)
        nbytes = _int(rec, "bytes", where)
        served_ram = rec.get("tier_served") == "ram"
        if served_ram and not all(k in rec for k in TIMED):
            issue = ready = need = 0
        else:
            issue, ready, need = (_int(rec, k, where) for k in TIMED)
            if ready < issue:
                raise InputError(where, f"ready_ns {ready} is before issue_ns {issue}")
        if "barrier_enter_ns" in rec and "barrier_exit_ns" in rec:
            if _int(rec, "barrier_exit_ns", where) < _int(rec, "barrier_enter_ns", where):
                raise InputError(where, "barrier_exit_ns is before barrier_enter_ns")
        run.keys.append((request, step, layer))
        run.expert.append(expert)
        run.segment.append(int(rec.get("segment_id", 0)))
        run.required.append(bool(rec["required"]))
        run.nbytes.append(nbytes)
        run.issue.append(issue)
        run.ready.append(ready)
        run.need.append(need)
        tier = rec.get("tier_at_prediction", rec.get("tier_served"))
        run.already.append(tier == "ram")
        run.speculative.append(rec.get("priority") == "speculative")
        run.used.append(bool(rec.get("used_before_eviction", rec["required"])))
    if not runs:
        raise InputError(path, "no records")
    return runs


def interval_union(starts: np.ndarray, ends: np.ndarray) -> int:
    """Total length (ns) covered by the union of the intervals [start, end)."""
    order = np.argsort(starts, kind="stable")
    total, cur_s, cur_e = 0, None, None
    for a, b in zip(starts[order].tolist(), ends[order].tolist()):
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def run_metrics(run: Run) -> dict:
    """Every seed 4.3 metric one run supports (ns and bytes)."""
    keys = run.keys
    req = np.array(run.required, dtype=bool)
    nb = np.array(run.nbytes, dtype=np.int64)
    issue, ready, need = (np.array(x, dtype=np.int64) for x in (run.issue, run.ready, run.need))
    already = np.array(run.already, dtype=bool)
    spec = np.array(run.speculative, dtype=bool)
    used = np.array(run.used, dtype=bool)
    groups: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    stall_by_step: dict[tuple, int] = {}
    stall_by_layer: dict[int, int] = {}
    union_bytes = 0
    for (request, step, layer), idx in groups.items():
        idx = np.array(idx)
        late = idx[req[idx] & (ready[idx] > need[idx])]
        w = interval_union(need[late], ready[late]) if len(late) else 0
        stall_by_step[(request, step)] = stall_by_step.get((request, step), 0) + w
        stall_by_layer[layer] = stall_by_layer.get(layer, 0) + w
        seen = {}
        for i in idx[req[idx]]:
            seen[(run.expert[i], run.segment[i])] = nb[i]
        union_bytes += sum(seen.values())
    steps = run.steps
    step_keys = sorted(set(steps) | set(stall_by_step))
    committed = np.array([steps[k]["committed_tokens"] if k in steps else 1 for k in step_keys], dtype=np.int64)
    stall = np.array([stall_by_step.get(k, 0) for k in step_keys], dtype=np.int64)
    A = int(committed.sum())
    per_step = stall[committed > 0] / committed[committed > 0]
    q = np.percentile(per_step, [50, 90, 95, 99]).tolist() if len(per_step) else [0] * 4
    not_ready = req & ~already
    timely = not_ready & (ready <= need)
    slack = (need - ready)[timely & spec]
    wall = [steps[k].get("wall_ns") for k in step_keys if k in steps]
    out = {
        "run_id": run.run_id,
        "steps": len(step_keys),
        "committed_tokens": A,
        "total_stall_ns": int(stall.sum()),
        "stall_per_committed_token_ns": float(stall.sum() / max(A, 1)),
        "step_stall_ns": {"p50": q[0], "p90": q[1], "p95": q[2], "p99": q[3], "max": float(per_step.max()) if len(per_step) else 0.0},
        "timely_required_byte_recall": float(nb[timely].sum() / nb[not_ready].sum()) if nb[not_ready].sum() else None,
        "unused_speculative_bytes": int(nb[spec & ~used].sum()),
        "speculative_bytes_per_token": float(nb[spec].sum() / max(A, 1)),
        "lead_slack_ns": {"p50": float(np.median(slack)), "p90": float(np.percentile(slack, 90))} if len(slack) else None,
        "union_bytes_per_committed_token": float(union_bytes / max(A, 1)),
        "records": len(keys),
        "_step_keys": step_keys,
        "_layer_stall": dict(sorted(stall_by_layer.items())),
        "_stall": stall,
        "_committed": committed,
    }
    if wall and all(isinstance(w, int) for w in wall):
        out["tpot_ns"] = float(sum(wall) / max(A, 1))
    out["token_hashes"] = {f"{k[0]}:{k[1]}": steps[k].get("token_hashes", steps[k].get("token_hash")) for k in step_keys if k in steps}
    return out


def public(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith("_") and k != "token_hashes"}


def public_report(r: dict) -> dict:
    """The report without its internal arrays (JSON-ready)."""
    return {k: v for k, v in r.items() if not k.startswith("_")}


def write_plots(r: dict, out_dir: str | Path, predicted: dict | None = None) -> list[Path]:
    """PNG figures: step-stall CDF, stall per layer, and predicted vs measured S (with a gate.json).

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
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in r["_runs"]:
        per = np.sort(m["_stall"] / np.maximum(m["_committed"], 1)) / 1e6
        ax.plot(per, np.arange(1, len(per) + 1) / max(len(per), 1), label=m["run_id"])
    ax.set_xlabel("stall per committed token in a step (ms)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("Step stall CDF")
    ax.legend(fontsize=7)
    written.append(_save(fig, out / "stall_cdf.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(len(r["_runs"]), 1)
    for i, m in enumerate(r["_runs"]):
        layers = list(m["_layer_stall"])
        vals = [m["_layer_stall"][l] / max(m["committed_tokens"], 1) / 1e6 for l in layers]
        ax.bar(np.arange(len(layers)) + i * width, vals, width, label=m["run_id"])
        ax.set_xticks(np.arange(len(layers)), [str(l) for l in layers], fontsize=6)
    ax.set_xlabel("layer")
    ax.set_ylabel("stall per committed token (ms)")
    ax.set_title("Stall per layer")
    ax.legend(fontsize=7)
    written.append(_save(fig, out / "stall_per_layer.png"))
    if predicted is not None:
        fig, ax = plt.subplots(figsize=(5, 4))
        measured = [m["stall_per_committed_token_ns"] / 1e6 for m in r["runs"]]
        pred = [predicted["baseline_metrics"]["stall_per_token_s"] * 1e3, predicted["plan_metrics"]["stall_per_token_s"] * 1e3]
        ax.bar(["predicted baseline", "predicted plan"], pred, color="tab:gray")
        ax.bar([f"measured {m['run_id']}" for m in r["runs"]], measured, color="tab:blue")
        ax.set_ylabel("S (ms per committed token)")
        ax.set_title("Predicted vs measured stall")
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        written.append(_save(fig, out / "predicted_vs_measured.png"))
    return written


def _save(fig, path: Path) -> Path:
    """Write a figure crash-safely (temp, fsync, rename); a full disk is one clear error."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        with atomic_output(path) as fh:
            fig.savefig(fh, dpi=110, format="png")
    finally:
        plt.close(fig)
    return path


def report(paths: list[str | Path]) -> dict:
    """Metrics of every run in ``paths`` and of all of them pooled."""
    runs = []
    for p in paths:
        for run in read_stall_trace(p).values():
            runs.append(run_metrics(run))
    stall = sum(int(m["_stall"].sum()) for m in runs)
    A = sum(int(m["_committed"].sum()) for m in runs)
    return {"runs": [public(m) for m in runs], "stall_per_committed_token_ns": stall / max(A, 1), "committed_tokens": A,
            "_runs": runs}


def compare(paths: list[str | Path], seed: int = 0) -> dict:
    """Paired comparison of configurations: each file holds one configuration's repetitions.

    Repetitions pair by order. The first file is the control. Output-token hashes that differ
    between runs claiming to be lossless are a correctness failure, not noise.
    """
    if len(paths) < 2:
        raise InputError(None, "compare needs at least two STALL_TRACE files (a control and a treatment)")
    configs = [[run_metrics(r) for r in read_stall_trace(p).values()] for p in paths]
    failures = _token_mismatches(paths, configs)
    control = configs[0]
    out = {"control": str(paths[0]), "correctness_failures": failures, "comparisons": []}
    for path, runs in zip(paths[1:], configs[1:]):
        n = min(len(control), len(runs))
        if n == 0:
            raise InputError(path, "no runs")
        base = np.array([m["_stall"].sum() for m in control[:n]], dtype=float)
        new = np.array([m["_stall"].sum() for m in runs[:n]], dtype=float)
        tok = np.array([m["_committed"].sum() for m in control[:n]], dtype=float)
        iv = paired_saving(base, new, tok, "repetition", seed=seed)
        diff = base / tok - new / np.array([m["_committed"].sum() for m in runs[:n]], dtype=float)
        sd = float(np.std(diff, ddof=1)) if n > 1 else 0.0
        s0 = float(base.sum() / tok.sum())
        s1 = float(new.sum() / max(sum(m["_committed"].sum() for m in runs[:n]), 1))
        spec = float(np.mean([m["speculative_bytes_per_token"] for m in runs[:n]]))
        out["comparisons"].append({
            "treatment": str(path), "pairs": n,
            "control_stall_per_committed_token_ns": s0, "treatment_stall_per_committed_token_ns": s1,
            "saving_ns": iv.to_json(), "relative_saving": (s0 - s1) / s0 if s0 else None,
            "effect_size_d": float(np.mean(diff) / sd) if sd > 0 else None,
            "stall_conversion_efficiency_ns_per_byte": (s0 - s1) / spec if spec > 0 else None,
            "per_pair_ns": [float(x) for x in diff],
        })
    return out


def _token_mismatches(paths, configs) -> list[str]:
    reference = None
    out = []
    for path, runs in zip(paths, configs):
        for m in runs:
            hashes = {k: v for k, v in m["token_hashes"].items() if v is not None}
            if not hashes:
                continue
            if reference is None:
                reference = (f"{path}:{m['run_id']}", hashes)
                continue
            ref_name, ref = reference
            for key in sorted(set(ref) & set(hashes)):
                if ref[key] != hashes[key]:
                    out.append(f"run {path}:{m['run_id']} emits different tokens than {ref_name} at request:step {key}")
                    break
    return out


