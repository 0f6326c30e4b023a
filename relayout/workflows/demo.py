"""``relayout demo``: the whole pipeline on a small built-in synthetic model, in seconds.

The model is the GLM-5.2 group-64 geometry (int8 MTP layer included) scaled down to 6 MoE layers
of 32 experts, so every code path of the real 429 GB container is exercised: build, inspect,
manifest, trace, plan, replay and gate, rewrite and verify, then both containers measured for real
in lockstep against the prediction. Its files are kept in a work directory it records
(:class:`~relayout.workflows.workdir.WorkDir`); times in seconds, S in ms per committed token.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from containers.atomic import write_bytes_atomic, write_json_atomic
from containers.container import MANIFEST_NAME, Container
from containers.geometry import load_geometry
from containers.manifest import build_manifest, check_container, write_manifest
from containers.synth import synth_container
from replay.physical.calibrate import calibrate
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.evaluation.evidence import block_evidence
from replay.evaluation.gate import compare, evaluation_forwards, run_layout
from replay.physical.measure import Arm, measure_interleaved
from replay.formats.planfile import load_plan, save_plan
from replay.physical.stalltrace import compare as compare_runs
from replay.physical.stalltrace import report as run_report
from replay.formats.trace import save_trace

from relayout.workflows.apply import apply_plan, verify
from relayout.render.gate import bottom_line
from relayout.planning.plan import make_plan, source_from_container
from relayout.render.containers import plan_summary
from relayout.render.measurements import completion_sentence, merge_sentence
from relayout.render.units import human_bytes
from relayout.traces.stats import trace_stats
from relayout.traces.synth import SynthParams, synth_trace

from .validation.rules import HARNESS_EXCESS, measured_vs_predicted
from .workdir import WorkDir

DEMO_GEOMETRY = "glm-5.2-int4-g64"
DEMO_SCALE = dict(moe_layers=6, experts=32, hidden=1024, ffn=256, shard_bytes=8_000_000, vocab=2048)
DEMO_TOKENS = 3200
DEMO_SESSIONS = 16
DEMO_TRAIN_FRACTION = 0.625
"""10 sessions train the plan, 6 are held out (a verdict needs at least 5)."""
DEMO_DEVICE = "linux-md-raid0-4x"
DEMO_MEASURE_TOKENS = 100
DEMO_REPETITIONS = 2
DEMO_MARKER = ".relayout-demo"
DEMO_CALIBRATION_MB = 256
DEMO_CALIBRATION_SECONDS = 0.15
"""A brief calibration of the local disk (20 cells of 0.15 s on a 256 MiB file): a rough profile."""


DEMO_DIR_NAME = "relayout-demo"
"""The demo's default directory under the current one (``relayout-demo``, else ``relayout-demo-2``, ...)."""


def default_demo_dir(parent: Path) -> Path:
    """The first of ``parent/relayout-demo``, ``parent/relayout-demo-2``, ... that does not exist."""
    n = 1
    while True:
        path = parent / (DEMO_DIR_NAME if n == 1 else f"{DEMO_DIR_NAME}-{n}")
        if not os.path.lexists(path):
            return path
        n += 1


def run_demo(work_dir: str | None = None, seed: int = 0) -> int:
    """Run the demo; its outputs are kept and listed.

    Only paths the demo recorded making (:class:`~relayout.workflows.workdir.WorkDir`) are ever
    removed (a previous demo's, when it runs again in the same directory).

    Parameters
    ----------
    work_dir : the directory to run in (new, empty or a previous demo's); None for a new folder
        under the current directory (:func:`default_demo_dir`).
    seed : the seed of the synthetic container, trace and plan.

    Returns
    -------
    The exit status: 0 when the container, its manifest check and the rewrite's full verify found
    no problem, else 1.
    """
    work = WorkDir.open(work_dir if work_dir is not None else default_demo_dir(Path.cwd()), DEMO_MARKER, "demo")
    try:
        return _run(work, seed)
    finally:
        work.seal()


def harness_sentence(runs: dict, model_compute: float) -> str:
    """In words: the compute the measuring harness ran per committed token (``runs``: label ->
    STALL_TRACE path) against the model's (s/token), and what an excess means for measured stall."""
    ran = {label: float(np.mean([m.published["compute_per_committed_token_ns"] for m in run_report([path]).runs])) / 1e9
           for label, path in runs.items()}
    said = ", ".join(f"{label} {c * 1e3:.3f}" for label, c in ran.items())
    if max(ran.values()) <= (1 + HARNESS_EXCESS) * model_compute:
        return f"   compute, ms/token: the harness ran {said}, the model {model_compute * 1e3:.3f}"
    return (f"   compute, ms/token: the harness ran {said}, the model {model_compute * 1e3:.3f}: the harness's own Python "
            "work ran beyond the emulated compute; its waits are timed in the compute model's time, so that work "
            "lengthens its steps rather than hiding stall (relayout validate --coalesce replays each run with the "
            "compute it ran)")


def _step(title: str) -> float:
    print(f"\n== {title}")
    return time.perf_counter()


def _run(work: WorkDir, seed: int) -> int:
    t0 = time.perf_counter()
    geometry = load_geometry(DEMO_GEOMETRY).scaled(**DEMO_SCALE)
    src = work.claim("source", "source.partial")
    t = _step(f"1. synthetic container ({DEMO_GEOMETRY}, scaled: {DEMO_SCALE['moe_layers']} MoE layers x {DEMO_SCALE['experts']} experts)")
    synth_container(src, geometry, seed=seed, progress=False)
    container = Container.open(src)
    r = container.report()
    print(f"   {src}: {r['files']} shard files, {r['tensors']} tensors, {human_bytes(r['total_bytes'])}  ({time.perf_counter() - t:.1f} s)")

    _step("2. inspect")
    print(f"   MoE layers {r['moe_layers'][0]}-{r['moe_layers'][-1]}, MTP layer {r['mtp_layers']}, "
          f"{r['routed_experts']} routed experts, {human_bytes(r['routed_bytes'])}")
    for fmt, sizes in r["bytes_per_expert"].items():
        for size, n in sizes.items():
            print(f"   {fmt}: {n} experts of {int(size):,} B")
    print(f"   fast path: {r['fast_path_experts']} experts are one read; {r['off_fast_path_experts']} straddle shard files")
    print(f"   problems: {len(r['problems']) or 'none'}")

    t = _step("3. checksum manifest (xxh3-128 per file and per tensor)")
    manifest = build_manifest(container, progress=False)
    write_manifest(manifest, src / MANIFEST_NAME)
    mismatches = check_container(src, progress=False)
    print(f"   fingerprint {manifest['fingerprint']}  content {manifest['content_fingerprint']}")
    print(f"   re-check: {len(mismatches)} mismatches  ({time.perf_counter() - t:.1f} s)")

    t = _step("4. synthetic routing trace (planted co-activation cliques, topics per session)")
    trace = synth_trace(geometry.moe_layers, geometry.n_routed_experts, geometry.num_experts_per_tok,
                        DEMO_TOKENS, DEMO_SESSIONS, seed, SynthParams(clique_strength=0.85), geometry=geometry.name)
    trace_path = work.claim("trace.rt")
    save_trace(trace, trace_path)
    stats = trace_stats(trace)["summary"]
    print(f"   {trace_path}: {DEMO_TOKENS} decode tokens in {DEMO_SESSIONS} sessions; heat entropy "
          f"{stats['heat_entropy_bits_median']} of {stats['max_entropy_bits']} bits, lift p90 {stats['lift_p90']}  "
          f"({time.perf_counter() - t:.1f} s)")

    n_train = round(DEMO_SESSIONS * DEMO_TRAIN_FRACTION)
    t = _step(f"5. plan: Louvain communities, spectral order, local search, packing (first {n_train} sessions train)")
    source = source_from_container(src)
    plan_path = work.claim("plan.json")
    save_plan(make_plan(trace, source, "louvain", train_fraction=DEMO_TRAIN_FRACTION, seed=seed, progress=False), plan_path)
    plan = load_plan(plan_path)
    for line in plan_summary(plan.raw):
        print("   " + line)
    print(f"   ({time.perf_counter() - t:.1f} s)")

    t = _step("6. replay held-out sessions and gate (Linux md RAID-0 of four NVMe drives)")
    device = load_device(DEMO_DEVICE)
    gates = {}
    for label, cfg in (("default runtime (8 workers)", RuntimeConfig(workers=8)),
                       ("1 worker, coalescing reads*", RuntimeConfig(workers=1, coalesce=True))):
        g = compare(plan, trace, device, cfg, seed=seed)
        gates[label] = g
        s = g.saving_per_token_s
        print(f"   {label:28} stock {g.baseline_metrics.stall_per_token_s * 1e3:7.3f} ms/token, "
              f"plan {g.plan_metrics.stall_per_token_s * 1e3:7.3f}, oracle {g.headroom.oracle_stall_s * 1e3:7.3f}; "
              f"saved {s.estimate * 1e3:.3f} [{s.low * 1e3:.3f}, {s.high * 1e3:.3f}] = "
              f"{g.saving_fraction_of_tpot.estimate:.1%} of TPOT -> {g.verdict.upper()}")
    print("   * coalescing needs a runtime change (colibrì pull request 1398, not merged): the demo shows where a "
          "layout matters most")
    gate = gates["1 worker, coalescing reads*"]
    d = gate.decomposition
    print(f"   of which repacking (source order, new files): {d.repacking.estimate * 1e3:.3f} ms/token, ordering: "
          f"{d.ordering.estimate * 1e3:.3f} [{d.ordering.low * 1e3:.3f}, {d.ordering.high * 1e3:.3f}]")
    write_json_atomic(work.claim("gate.json"), gate.to_json())
    print(f"   gate.json: {gate.reason}  ({time.perf_counter() - t:.1f} s)")

    t = _step("7. rewrite (the gate passed) into DST and verify byte for byte")
    dst = work.claim("relaid", "relaid.partial")
    forced = gate.verdict != "pass"
    if forced:
        print("   the gate failed on this run; rewriting anyway with the demo's explicit override (recorded as forced)")
    new_manifest = apply_plan(src, plan, dst, gate, force=forced, progress=False)
    problems, _ = verify(src, dst, full=True, progress=False)
    print(f"   {dst}: {len(new_manifest['files'])} files, every expert one read; content fingerprint "
          f"{new_manifest['content_fingerprint']} (source {manifest['content_fingerprint']})")
    print(f"   verify --full: {len(problems)} problems  ({time.perf_counter() - t:.1f} s)")

    t = _step("8. measure both containers for real (cold reads, 1 worker, coalescing, in lockstep) and compare")
    mask, _ = evaluation_forwards(trace, [plan])
    mask &= np.cumsum(mask) <= DEMO_MEASURE_TOKENS
    cfg = RuntimeConfig(workers=1, coalesce=True)
    runs = {"stock": [], "relaid": []}
    for rep in range(DEMO_REPETITIONS):             # both step by step, so both see the disk of the same seconds
        arms = [Arm(Container.open(path), cfg, work.claim(f"measure-{label}-{rep}.jsonl"), run_id=f"{label}-{rep}")
                for label, path in (("stock", src), ("relaid", dst))]
        measure_interleaved(arms, trace, mask, progress=False)
        for label, arm in zip(("stock", "relaid"), arms):
            runs[label].append(arm.out)
    for label in runs:
        merged = work.claim(f"measure-{label}.jsonl")
        write_bytes_atomic(merged, b"".join(p.read_bytes() for p in runs[label]))
        runs[label] = merged
    cmp = compare_runs([runs["stock"], runs["relaid"]])
    x = cmp["comparisons"][0]
    s = x["saving_ns"]
    print(f"   measured S: stock {x['control_stall_per_committed_token_ns'] / 1e6:.3f} ms/token, relaid "
          f"{x['treatment_stall_per_committed_token_ns'] / 1e6:.3f}; saved {s['estimate'] / 1e6:.3f} ms "
          f"[{s['low'] / 1e6:.3f}, {s['high'] / 1e6:.3f}] over {x['pairs']} paired repetitions of {DEMO_MEASURE_TOKENS} steps")
    print(f"   predicted on the '{DEMO_DEVICE}' profile (not this machine): saved {gate.saving_per_token_s.estimate * 1e3:.3f} ms")
    profile = calibrate(work.path, size_mb=DEMO_CALIBRATION_MB, seconds=DEMO_CALIBRATION_SECONDS, name="this-disk (demo, brief)")
    write_json_atomic(work.claim("this-disk.json"), profile)
    local = load_device(str(work.path / "this-disk.json"))
    base = run_layout("stock", trace, mask, plan.stock, local, cfg, np.zeros((len(plan.layout.layers), plan.layout.n_experts), bool))
    new = run_layout("relaid", trace, mask, plan.layout, local, cfg, np.zeros((len(plan.layout.layers), plan.layout.n_experts), bool))
    ev = block_evidence(base.steps.stall, new.steps.stall, base.steps.committed, base.steps.session)
    est, low, high = (x * 1e3 for x in ev.interval())
    print(f"   predicted on this disk, calibrated briefly ({local.drive.bandwidth / 1e9:.2f} GB/s, "
          f"{local.drive.request_seconds * 1e6:.0f} us per command, {local.drive.request_channel_seconds * 1e6:.0f} us of "
          f"channel per request): stock {base.summary.stall_per_token_s * 1e3:.3f}, relaid "
          f"{new.summary.stall_per_token_s * 1e3:.3f} ms/token; saved {est:.3f} ms [{low:.3f}, {high:.3f}] on the same steps")
    print("   " + measured_vs_predicted(s["estimate"] / 1e6, s["low"] / 1e6, s["high"] / 1e6, est))
    print(harness_sentence(runs, base.summary.compute_per_token_s))
    spread = completion_sentence(profile)
    if spread and spread[1]:
        print("   this disk: " + spread[0])
    merge = merge_sentence(profile)
    if merge:
        print("   this disk: " + merge[0])
    print("   (relayout validate PATH asks the same question properly: more layouts, budgets, repetitions)")
    print(f"   ({time.perf_counter() - t:.1f} s)")

    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s; its files are in {work.path}:")
    for name, what in (("source/", "the synthetic container (stock layout) and its manifest"),
                       ("trace.rt", "the routing trace (16 sessions)"), ("plan.json", "the Louvain plan"),
                       ("gate.json", "the gate's record (relayout gate --recheck gate.json recomputes it)"),
                       ("relaid/", "the rewritten container, verified byte for byte"),
                       ("measure-stock.jsonl, measure-relaid.jsonl", "the measured runs (relayout compare reads them)"),
                       ("this-disk.json", "the brief profile of this disk")):
        print(f"   {name:44} {what}")
    print("\n" + bottom_line(gate, str(work.path / "plan.json"), str(work.path / "gate.json"), str(src), str(dst), forced))
    print("With your own model: README.md, 'With your colibrì model'.")
    return 0 if not mismatches and not r["problems"] and not problems else 1
