"""S and its neighbours from colibrì runs' own measurements, per run, per arm, and arm against arm.

Every figure is the engine's: the decode window's ``PROFILE:`` times over its committed tokens
(:mod:`replay.colibri.engine_output`). Units are milliseconds per committed token unless a name says
otherwise:

- ``s_ms``: S, the compute thread's wait for expert bytes (the foreground stall) per token;
- ``tpot_ms``: the decode window's wall time per token;
- ``service_ms``: the loading threads' read time per token (overlaps compute; 0 in ``URING`` mode,
  where the engine does not time it);
- ``matmul_ms``, ``attention_ms``, ``other_ms``: the engine's other ``PROFILE:`` terms per token;
- ``hit_rate``: expert requests served from RAM (pins and LRU) over all requests, a fraction;
- ``loads_per_token``: experts loaded (cache misses) per committed token;
- ``forward_p50_ms``, ``forward_p99_ms``: the engine's decode-forward latency quantiles (``PROF=1``).

An arm's S is its summed wait over its summed tokens; its interval's half-width is Student's t
over its runs' own S (each run one unit), set about that S. Arms compare pair by pair: runs pair by (prompt, repetition) when
relayout measured them, else by their prompt's token ids and order; the saving's interval is
Student's t over the pairs' savings (:func:`replay.physical.stalltrace.paired_ratio_saving`). Two runs of one
prompt whose greedy output tokens differ are a correctness failure, not noise.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from containers.errors import InputError

from replay.colibri.engine_config import EngineConfig
from replay.colibri.engine_output import EngineRun, read_runs
from replay.physical.stalltrace import paired_ratio_saving
from replay.evaluation.stats import repetition_interval

RUNTIME_VARIABLES = tuple(f.name for f in fields(EngineConfig)) + ("DRAFT", "MTP", "COLI_MODEL_DIRS", "COLI_MODEL_MIRROR",
                                                                  "COLI_DISK_WEIGHTS")
"""The variables a run's configuration label shows when set: the read path's (:class:`EngineConfig`),
speculative decoding's and the drives'."""


@dataclass(frozen=True)
class EngineRunMetrics:
    """One run's figures (see the module docstring for units); ``None`` where the run did not print them."""

    source: str
    arm: str
    key: str
    committed_tokens: int
    wait_s: float
    s_ms: float
    tpot_ms: float | None
    service_ms: float | None
    matmul_ms: float | None
    attention_ms: float | None
    other_ms: float | None
    hit_rate: float | None
    loads_per_token: float | None
    forwards: int | None
    forward_p50_ms: float | None
    forward_p99_ms: float | None
    configuration: str
    returncode: int | None
    load_average: float | None
    pilot_loads: int | None = None      # the router pilot's completed loads (PILOT_REAL=1's line), the whole run
    pilot_drops: int | None = None      # its predictions dropped (layer reached, no slot, eviction guard)
    pilot_lookahead: list | None = None  # LOOKA=1: [hits, total] of its prediction against the next layers' experts
    drive_read_bytes: int | None = None  # bytes the engine process read from storage, the whole run (relayout measure counted them)
    memory_room: int | None = None       # bytes its memory control group left it (None: no limit, or not measured by relayout)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d, where: str = "engine run metrics") -> "EngineRunMetrics":
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            raise InputError(where, f"expected exactly the fields {sorted(names)}")
        return cls(**d)


def configuration_label(run: EngineRun) -> str:
    """The run's configuration in the engine's terms: the runtime variables it set (when relayout
    measured it), then the effective ``[PROF] config`` values and the cache cap it printed."""
    parts = []
    env = run.identity.env if run.identity else {}
    parts += [f"{k}={env[k]}" for k in RUNTIME_VARIABLES if k in env]
    out = run.output
    printed = [f"{k}={out.config[k]}" for k in ("PIPE", "DIRECT", "MMAP", "DRAFT", "PILOT") if k in out.config]
    if printed:
        parts.append("[config " + " ".join(printed) + "]")
    if out.cap is not None:
        parts.append(f"[cap {out.cap}/layer" + (", RAM_GB auto" if out.ram_auto else f", RAM_GB {out.ram_gb:g}" if out.ram_gb is not None else "") + "]")
    return " ".join(parts) if parts else "(configuration not printed: run with PROF=1)"


def _pair_keys(runs: list[EngineRun]) -> list[str]:
    keys, seen = [], Counter()
    for r in runs:
        if r.identity is not None:
            keys.append(f"prompt {r.identity.prompt} repetition {r.identity.repetition}")
            continue
        prompt = tuple(r.output.prompt_tokens) if r.output.prompt_tokens is not None else None
        seen[prompt] += 1
        name = (f"prompt tokens #{hashlib.blake2b(repr(prompt).encode(), digest_size=4).hexdigest()}"
                if prompt is not None else "unknown prompt")
        keys.append(f"{name} occurrence {seen[prompt]}")
    return keys


def run_metrics(run: EngineRun, arm: str, key: str) -> EngineRunMetrics:
    out = run.output
    tokens, wait = out.committed_tokens, out.wait_s
    if not tokens or wait is None:
        raise InputError(run.source, "the run printed no committed tokens or no decode wait: S cannot be taken")
    per = 1e3 / tokens
    d = out.decode if not out.serve_turns else None
    turns = out.serve_turns
    matmul = d.matmul_s if d else (sum(t.matmul_s for t in turns) if turns else None)
    attention = d.attention_s if d else (sum(t.attention_s for t in turns) if turns else None)
    service = d.service_s if d else (sum(t.service_s for t in turns) if turns else None)
    decode_s = out.decode_s if not turns else sum(t.wall_s for t in turns)
    io = out.expert_io
    hit = None
    if io is not None and io.pin_hits + io.lru_hits + io.loads:
        hit = (io.pin_hits + io.lru_hits) / (io.pin_hits + io.lru_hits + io.loads)
    return EngineRunMetrics(
        source=run.source, arm=arm, key=key, committed_tokens=tokens, wait_s=wait, s_ms=wait * per,
        tpot_ms=decode_s * per if decode_s is not None else None,
        service_ms=service * per if service is not None else None,
        matmul_ms=matmul * per if matmul is not None else None,
        attention_ms=attention * per if attention is not None else None,
        other_ms=d.other_s * per if d else None,
        hit_rate=hit, loads_per_token=io.loads / tokens if io is not None else None,
        forwards=out.forwards.forwards if out.forwards else (sum(t.forwards for t in turns) if turns else None),
        forward_p50_ms=out.forwards.p50_ms if out.forwards else None,
        forward_p99_ms=out.forwards.p99_ms if out.forwards else None,
        configuration=configuration_label(run),
        returncode=run.identity.returncode if run.identity else None,
        load_average=run.identity.load_average if run.identity else None,
        pilot_loads=out.pilot_loads, pilot_drops=out.pilot_drops, pilot_lookahead=out.pilot_lookahead,
        drive_read_bytes=run.identity.drive_read_bytes if run.identity else None,
        memory_room=run.identity.memory_room if run.identity else None)


def _arm_name(path: str | Path, runs: list[EngineRun]) -> str:
    arms = {r.identity.arm for r in runs if r.identity}
    return arms.pop() if len(arms) == 1 else str(path)


def arm_runs(path: str | Path) -> tuple[str, list[EngineRun], list[EngineRunMetrics]]:
    runs = read_runs(path)
    arm = _arm_name(path, runs)
    metrics = [run_metrics(r, arm, k) for r, k in zip(runs, _pair_keys(runs))]
    return arm, runs, metrics


def _mean(values) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


def _weighted(metrics: list[EngineRunMetrics], name: str) -> float | None:
    """Sum over runs of (per-token figure x tokens) over summed tokens: the arm's per-token figure."""
    pairs = [(getattr(m, name), m.committed_tokens) for m in metrics if getattr(m, name) is not None]
    if not pairs:
        return None
    return float(sum(v * t for v, t in pairs) / sum(t for _, t in pairs))


def _per_token(metrics: list[EngineRunMetrics], name: str) -> float | None:
    """A count the runs printed (``name``), summed over them, per committed token of those runs."""
    runs = [(getattr(m, name), m.committed_tokens) for m in metrics if getattr(m, name) is not None]
    return float(sum(v for v, _ in runs) / sum(t for _, t in runs)) if runs else None


def _pooled_share(pairs: list) -> float | None:
    """``[hits, total]`` pairs pooled: hits over total (None for none)."""
    total = sum(t for _, t in pairs)
    return float(sum(h for h, _ in pairs) / total) if total else None


def arm_summary(path: str | Path, arm: str, metrics: list[EngineRunMetrics]) -> dict:
    tokens = sum(m.committed_tokens for m in metrics)
    s = sum(m.wait_s for m in metrics) / tokens * 1e3
    iv = repetition_interval([m.s_ms for m in metrics], "run")
    hits = [m.hit_rate for m in metrics if m.hit_rate is not None]
    return {
        "path": str(path), "arm": arm, "runs": len(metrics), "committed_tokens": tokens,
        "stall_per_committed_token_ms": s,
        "stall_per_committed_token_ms_interval": {**iv.to_json(), "estimate": s, "low": s - (iv.high - iv.low) / 2,
                                                 "high": s + (iv.high - iv.low) / 2,
                                                 "spread_of": "runs' own S, Student t 95%, about the pooled S"},
        "tpot_ms": _weighted(metrics, "tpot_ms"), "service_ms_per_token": _weighted(metrics, "service_ms"),
        "matmul_ms_per_token": _weighted(metrics, "matmul_ms"), "attention_ms_per_token": _weighted(metrics, "attention_ms"),
        "other_ms_per_token": _weighted(metrics, "other_ms"),
        "hit_rate": _mean(hits), "loads_per_token": _weighted(metrics, "loads_per_token"),
        "forward_latency_p50_ms_mean_over_runs": _mean(m.forward_p50_ms for m in metrics),
        "forward_latency_p99_ms_mean_over_runs": _mean(m.forward_p99_ms for m in metrics),
        "configurations": sorted({m.configuration for m in metrics}),
        "failed_runs": [m.source for m in metrics if m.returncode not in (None, 0)],
        "load_average": _mean(m.load_average for m in metrics),
        "pilot_loads_per_token": _per_token(metrics, "pilot_loads"),
        "pilot_drops_per_token": _per_token(metrics, "pilot_drops"),
        "pilot_precision": _pooled_share([m.pilot_lookahead for m in metrics if m.pilot_lookahead]),
        "drive_read_bytes_per_token": _per_token(metrics, "drive_read_bytes"),
        "memory_room_bytes": _mean(m.memory_room for m in metrics),
        "per_run": [m.to_json() for m in metrics],
    }


def engine_report(paths: list[str | Path]) -> dict:
    """Per argument (a run, a directory of runs, or an output file): its runs' S and neighbours."""
    arms = []
    for p in paths:
        arm, _, metrics = arm_runs(p)
        arms.append(arm_summary(p, arm, metrics))
    return {"source": "its own PROFILE measurements, read from its output", "arms": arms}


def engine_compare(paths: list[str | Path]) -> dict:
    """Paired comparison of arms (first argument = control), each argument one arm's runs."""
    if len(paths) < 2:
        raise InputError(None, "compare needs at least two arms of engine runs (a control and a treatment)")
    loaded = [arm_runs(p) for p in paths]
    c_arm, c_runs, c_metrics = loaded[0]
    c_by_key = {m.key: (r, m) for r, m in zip(c_runs, c_metrics)}
    out = {"source": "its own PROFILE measurements, read from its output", "control": str(paths[0]),
           "control_arm": c_arm, "correctness_failures": [], "warnings": [], "comparisons": []}
    for path, (arm, runs, metrics) in zip(paths[1:], loaded[1:]):
        pairs = [(c_by_key[m.key], (r, m)) for r, m in zip(runs, metrics) if m.key in c_by_key]
        unpaired = len(metrics) - len(pairs)
        if unpaired:
            out["warnings"].append(f"{path}: {unpaired} run(s) without a control run of the same prompt and repetition")
        if not pairs:
            raise InputError(path, "no run pairs with the control (same prompt and repetition)")
        for (cr, cm), (tr, tm) in pairs:
            a, b = cr.output.output_tokens, tr.output.output_tokens
            if a is not None and b is not None and a != b:
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                out["correctness_failures"].append(
                    f"{tm.source} emits different tokens than {cm.source} ({tm.key}): first difference at output token {first}")
        base = np.array([cm.wait_s for (_, cm), _ in pairs])
        new = np.array([tm.wait_s for _, (_, tm) in pairs])
        btok = np.array([cm.committed_tokens for (_, cm), _ in pairs], dtype=float)
        ntok = np.array([tm.committed_tokens for _, (_, tm) in pairs], dtype=float)
        iv = paired_ratio_saving(base * 1e3, btok, new * 1e3, ntok, "run pair (prompt x repetition)")
        s0, s1 = float(base.sum() / btok.sum() * 1e3), float(new.sum() / ntok.sum() * 1e3)
        tokens_compared = sum(1 for (cr, _), (tr, _) in pairs
                              if cr.output.output_tokens is not None and tr.output.output_tokens is not None)
        out["comparisons"].append({
            "treatment": str(path), "treatment_arm": arm, "pairs": len(pairs),
            "pairs_with_output_tokens": tokens_compared,
            "control_stall_per_committed_token_ms": s0, "treatment_stall_per_committed_token_ms": s1,
            "saving_ms_per_token": iv.to_json(), "relative_saving": (s0 - s1) / s0 if s0 else None,
            "control_tpot_ms": _weighted([cm for (_, cm), _ in pairs], "tpot_ms"),
            "treatment_tpot_ms": _weighted([tm for _, (_, tm) in pairs], "tpot_ms"),
            "control_configurations": sorted({cm.configuration for (_, cm), _ in pairs}),
            "treatment_configurations": sorted({tm.configuration for _, (_, tm) in pairs}),
            "per_pair_saving_ms": [float(cm.s_ms - tm.s_ms) for (_, cm), (_, tm) in pairs],
        })
    return out
