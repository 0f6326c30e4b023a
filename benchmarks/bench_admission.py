"""Prediction sources and admission policies on a synthetic GLM-5.2 trace.

Usage: python benchmarks/bench_admission.py [--tokens 4000] [--sessions 8] [--ram-gb 64]
       [--device mac-pro-2019-applraid-4x] [--dense-ms 1.0]

A synthetic trace (relayout.traces.synth, GLM-5.2 geometry: 75 MoE layers, 256 experts, top-8)
of ``--sessions`` sessions; the first half trains, the second half is held out. Prints:

1. each prediction source's held-out Brier score and expected calibration error (every expert of
   every predicted layer is a candidate), the same for the coupled and persistence sources fused
   (replay.control.sources.learn_fused), and the late-need probability q's scores from a replay that
   observes without loading;
2. the admission arms at equal budgets (Q = 6 queue slots, B = 6 experts' bytes per layer, the
   coupled source's probabilities for every policy; oracle: the true experts): S, the saving
   against no prefetch, eta_stall, timely required-byte recall, speculative and unused bytes,
   loads, rejected and cancelled candidates per committed token, the drives' mean queue depth
   and the p50/p95/p99/max step stall; then H2's verdict (replay.evaluation.hypotheses);
3. the tail-control arms (E5) on the probability-first policy: default, stale cancellation, the
   queue-aware adaptive budget, backoff and all three, with the same columns, then all three over
   the fused coupled+persistence probability without and with per-source caps (half of B and Q
   each; "capped": candidates per token a cap skipped); then H5's verdict.

Synthetic routing has little structure a predictor can use, so these figures describe the
machinery on one synthetic regime, not colibrì on real traces.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from containers.geometry import load_geometry
from relayout.planning.plan import source_from_geometry
from relayout.traces.synth import synth_trace
from replay.model.controller import admission_counts
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.model.engine import simulate
from replay.evaluation.gate import run_layout
from replay.evaluation.hypotheses import admission_table, arm_from_run, tail_table
from replay.control.sources import learn_fused, learn_source, reliability, score_source


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--ram-gb", type=float, default=64)
    ap.add_argument("--device", default="mac-pro-2019-applraid-4x")
    ap.add_argument("--dense-ms", type=float, default=1.0, help="dense time per layer (attention, router), ms")
    args = ap.parse_args()
    g = load_geometry("glm-5.2-int4-row")
    trace = synth_trace(g.moe_layers, 256, 8, args.tokens, args.sessions, seed=1, geometry=g.name)
    lay = source_from_geometry(g).stock
    dev = load_device(args.device)
    half = args.sessions // 2
    train, test = trace.session_forward_mask(list(range(half))), trace.session_forward_mask(list(range(half, args.sessions)))
    print(f"{args.tokens} tokens in {args.sessions} sessions ({int(train.sum())} training forwards, {int(test.sum())} "
          f"held out); {args.device}; LRU {args.ram_gb:g} GB; dense {args.dense_ms:g} ms per layer\n")

    print("1. prediction sources on held-out sessions (candidates: every expert of every predicted layer)")
    models = {}
    for name in ("heat", "persistence", "coupled", "session", "oracle"):
        t = time.perf_counter()
        models[name] = learn_source(name, trace, train, lay)
        r = score_source(models[name], trace, test, lay)
        print(f"   {name:<12} Brier {r.brier:.5f}  ECE {r.ece:.5f}  base rate {r.base_rate:.4f}  "
              f"(constant base rate: Brier {r.base_rate * (1 - r.base_rate):.5f}; {time.perf_counter() - t:.1f} s)")
    t = time.perf_counter()
    fused = models[FUSED] = learn_fused(tuple(FUSED.split("+")), trace, train, lay)
    r = score_source(fused, trace, test, lay)
    print(f"   {FUSED} fused (weights {', '.join(f'{w:+.3f}' for w in fused.coef)}): Brier {r.brier:.5f}  ECE {r.ece:.5f}  "
          f"({time.perf_counter() - t:.1f} s)")
    base = RuntimeConfig(ram_bytes=int(args.ram_gb * 1e9), dense_seconds=args.dense_ms * 1e-3)
    inst, _ = simulate(trace, test, lay, dev, replace(base, prefetch="coupled", admission="observe"), coupling=models["coupled"])
    p = inst.prefetch
    q = reliability("q (coupled)", p.late_n, p.late_p, p.late_y, p.late_sq)
    print(f"   late-need q of the coupled source (needed, not in RAM, and its demand load made the compute thread "
          f"wait): Brier {q.brier:.5f}  ECE {q.ece:.5f}  event rate {q.base_rate:.4f}\n")

    budget = dict(prefetch_experts=6, prefetch_bytes=6 * int(lay.expert_bytes()[0, 0]))
    arms = {"none": base}
    arms.update({pol: replace(base, prefetch="coupled", admission=pol, **budget)
                 for pol in ("probability", "per-byte", "deadline", "stall-value")})
    arms["oracle"] = replace(base, prefetch="oracle", admission="oracle", **budget)
    print("2. admission at equal budgets (Q = 6 slots, B = 6 experts per layer; coupled probabilities)")
    runs = _table(arms, trace, test, lay, dev, models)
    h2 = admission_table({k: arm_from_run(r, k) for k, r in runs.items()}, f"synthetic GLM-5.2, {args.device}")
    print(f"   H2: {h2.verdict} ({h2.sufficiency}; {h2.reason})\n")

    default = replace(base, prefetch="coupled", admission="probability", **budget)
    tails = {"none": base, "default": default, "cancel-stale": replace(default, cancel_stale=True),
             "adaptive-budget": replace(default, adaptive_budget=True), "backoff": replace(default, backoff=True),
             "tail-control": replace(default, cancel_stale=True, adaptive_budget=True, backoff=True)}
    tails["fused control"] = replace(tails["tail-control"], prefetch=FUSED)
    tails["fused + caps"] = replace(tails["fused control"], source_caps=(0.5, 0.5))
    print("3. tail control on probability-first admission (E5)")
    runs = _table(tails, trace, test, lay, dev, models)
    h5 = tail_table({k: arm_from_run(r, k) for k, r in runs.items() if k != "none"}, f"synthetic GLM-5.2, {args.device}")
    print(f"   H5: {h5.verdict} ({h5.sufficiency}; {h5.reason})")


FUSED = "coupled+persistence"
"""The two sources sections 1 and 3 fuse."""


def _table(arms, trace, test, lay, dev, models) -> dict:
    """Replay each arm on the held-out forwards and print its line; returns the runs."""
    print(f"   {'arm':<16}{'S ms/tok':>9}{'saving':>8}{'eta ms/GB':>10}{'recall':>7}{'spec MB':>8}{'unused MB':>10}"
          f"{'loads':>7}{'reject':>8}{'capped':>7}{'cancel':>7}{'queue':>6}{'p50':>7}{'p95':>7}{'p99':>7}{'max':>7}"
          "  (per token; ms)")
    runs, s0 = {}, None
    for name, cfg in arms.items():
        model = models.get(cfg.prefetch)
        t = time.perf_counter()
        run = run_layout(name, trace, test, lay, dev, cfg, np.zeros((len(lay.layers), lay.n_experts), bool),
                         coupling=model)
        dt = time.perf_counter() - t
        runs[name] = run
        m, c = run.summary, admission_counts(run.steps)
        S = m.stall_per_token_s
        s0 = S if s0 is None else s0
        spec = c.speculative_bytes if c else 0.0
        eta = f"{(s0 - S) * 1e3 / (spec / 1e9):10.3f}" if spec > 0 else f"{'-':>10}"
        rec = m.prefetch.timely_required_byte_recall if m.prefetch else None
        q = m.step_stall_s
        print(f"   {name:<16}{S * 1e3:9.2f}{(s0 - S) * 1e3:8.2f}{eta}{rec if rec is not None else 0:7.3f}"
              f"{spec / 1e6:8.1f}{(c.unused_bytes if c else 0) / 1e6:10.1f}{(c.loads if c else 0):7.1f}"
              f"{(c.rejected if c else 0):8.1f}{(c.capped if c else 0):7.1f}{(c.cancelled if c else 0):7.1f}"
              f"{np.mean(m.drive_queue_depth):6.2f}"
              f"{q.p50 * 1e3:7.1f}{q.p95 * 1e3:7.1f}{q.p99 * 1e3:7.1f}{q.max * 1e3:7.1f}  [{dt:.1f} s]")
    return runs


if __name__ == "__main__":
    main()
