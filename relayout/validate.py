"""``relayout validate PATH``: does the replay model hold on this disk? Predicted S against measured S.

What a user runs before trusting a gate on their own storage (issue 12). It

1. takes a container on that disk (``--container``, only ever read) or builds a synthetic
   GLM-5.2 int4-row container with full-size 18.9 MB experts, about ``gb`` GB, in a work
   directory under ``PATH``; synthesises a routing trace for it (:data:`TRACE_SESSIONS`
   sessions, of which the last :data:`HELD_OUT_SESSIONS` are held out), plans each layout
   (``stock``, ``louvain``, ``random``) and rewrites the non-stock ones next to it, and with a
   synthetic source the stock one too (its order unchanged), so every measured container is a
   file the rewriter wrote: a disk may serve files written one way at another speed (measured
   from the synthesised source, stock ran 4-7 ms/token slower than the rewritten layouts in
   7 of 12 comparisons, while at equal disk speed the layouts differed by about 1 ms/token,
   ``docs/BENCHMARKS.md``); a ``--container`` is measured where it is, as stock; and one more
   rewrite of the stock plan, the placement control (:data:`PLACEMENT_COPY`), measured beside
   stock in every block: the same bytes in the same order in another file, so what S differs
   by between the two is placement alone (a fresh copy of stock ran 11% faster than stock on
   this project's disk), and a measured layout saving within it is not read as the layout's.
   All the rewrites run at once (one thread each): written one after another, the containers
   written later read faster on this project's disk in every block of four runs, a bias
   against stock, written first, of 2-10 ms/token (``docs/BENCHMARKS.md``);
2. reads every container once (:func:`_read_each_once`: a virtual disk may serve a block slower
   the first time it is read, which would favour the freshly written copies);
3. calibrates the disk holding ``PATH`` (:func:`replay.physical.calibrate.calibrate`) unless a device
   profile is given, on the stock container's largest file when it can
   (:func:`calibration_target`), and saves the profile next to the output; then, for every
   cell (layout x RAM budget x prefetch source), measures S for real
   (:func:`replay.physical.measure.measure_interleaved`, cold) ``reps`` times, the layouts and prefetch
   sources of a RAM budget measured together, step by step in lockstep (every run's step j
   before any run's step j + 1, their order rotating each step from a counterbalanced one:
   :func:`measurement_order`), so every run of a block sees the disk of the same seconds (each
   run holds its own read buffers: ``workers + 1`` of an expert's size, about 1.5 GB for the
   default block of 9 runs of 18.9 MB experts), on the same first ``tokens`` held-out steps,
   and predicts S by replaying exactly those steps on the profile (:func:`replay.model.engine.simulate`). A probe
   (:func:`replay.physical.calibrate.probe_rate`: reads of one expert's size, as many at once as the
   runtime's workers, for 1 s on the container's largest file) before the first repetition and
   after each follows the disk's speed at the measured runs' operating point; each repetition
   is also predicted on the profile scaled (:meth:`replay.model.device.ArrayProfile.scaled`) by the
   probes around it over the rate the profile gives the probe's reads: a diagnosis of a
   drifting disk beside the verdict, which stays on the profile as calibrated. Finer, each
   measured run is also predicted at the rate its own drive served it (:func:`at_run_speed`:
   the run's drive bytes over the time a drive load was under way, the model scaled until its
   own rate agrees), which separates the model's read path, queueing and overlap with compute
   from the forecast of a drifting disk's speed; and at the speed of the runs interleaved with
   it (:func:`neighbour_scales`), which tests the prediction on a measurement its speed was not
   read off; and at its drive's speed with the compute its harness ran (:func:`at_harness_compute`:
   a check of the harness, whose own Python work can run beyond the emulated compute where each
   expert's compute is short and reads are many); and at its drive's speed less its waits for
   experts whose own reads the page cache served (:func:`replay.physical.stalltrace.page_cache_wait`: a
   coalesced run's later experts, whose scale reads a Python harness serves in tens of
   microseconds and the runtime in a few, a wait the model does not predict); diagnoses too;
4. compares: predicted/measured S per cell, with the measured S's 95% interval over the
   repetitions (each repetition one unit: the disk's drift between runs is the larger part of
   the uncertainty, and no resampling of steps within runs sees it); per non-stock layout the
   predicted and the measured saving against stock at the same RAM budget and prefetch source
   (predicted: a 95% moving-block bootstrap interval over the held-out steps; measured: the
   95% interval over the repetitions' savings, both layouts of a repetition measured
   interleaved), whether the predicted saving lies in the measured interval, whether the signs agree
   where the measured interval excludes zero, and whether the gate's decision (the saving's low
   end at least :data:`GATE_THRESHOLD` of TPOT) is the same; per prefetch source, its saving
   against no prefetch (same layout and RAM) the same way, and whether the prediction is within
   :data:`PREFETCH_TOLERANCE` of the measurement; and per cell the demand reads that reach the
   drive per token, the model's against the harness's records' (:func:`drive_reads_check`,
   where the harness read weights with O_DIRECT): the one read path plans the same preads for
   both, so a difference there is in what the page cache serves;
5. writes ``validation.json`` (format :data:`VALIDATION_FORMAT`, version
   :data:`VALIDATION_VERSION`) and, with ``plots``, a predicted-vs-measured scatter.

The verdict (:func:`judge_record`, :func:`summarize_validation`) is one of three, over the run's
judgements (each cell's S, each layout's saving and each prefetch source's saving). A 95% interval misses its true value one time in twenty, so a run
of 42 judgements misses about two by chance alone. So a prediction is ruled out only beyond its
*family* interval, at the coverage each judgement needs for all of them to hold together 95% of
the time (Bonferroni, :func:`replay.evaluation.stats.family_level`; at 4 repetitions 3.8 times as wide as
the 95% one), widened by the tolerance where there is one (a cell's S: :data:`TOLERANCE`; a
prefetch saving: :data:`PREFETCH_TOLERANCE`) and, for a layout's saving, by what the placement
control shows placement alone does to S (the difference between two containers is their layouts'
and their files' placement on the disk). The model *does not hold* when a measurement rules a
prediction out; short of that, fewer than :data:`VERDICT_REPS` repetitions per cell are
*insufficient* for a verdict. It *holds* when every cell's predicted/measured ratio is within
:data:`TOLERANCE` of 1, no more savings miss their 95% interval than chance gives a correct
model in 95% of runs (:func:`replay.evaluation.stats.chance_misses`: 3 of 24) and the gate decides alike on
every comparison whose prediction is not off by placement. Otherwise it is *inconclusive*: the
repetitions scatter too widely to confirm or refute it, and the summary says to measure more,
or a layout saving is off by no more than placement, which no number of repetitions separates.

Units: S, savings and TPOT in seconds per committed token in the record (``_s``), milliseconds
in text; sizes in bytes; RAM budgets as fractions of the routed bytes of the traced layers.

The work directory (``PATH/relayout-validate``) carries :data:`WORK_MARKER`, the record of every
path this command made there (:class:`~relayout.workdir.WorkDir`): an existing non-empty
directory without it is refused, and at the end, unless ``keep``, exactly the recorded paths are
removed; anything else found there is kept and named.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
from containers.progress import progress_bar

from containers import __version__
from containers.atomic import atomic_output, make_dirs, write_json_atomic
from containers.container import MANIFEST_NAME, Container
from containers.errors import InputError
from containers.geometry import load_geometry
from containers.manifest import build_manifest, write_manifest
from containers.synth import synth_container
from replay.model.config import PREFETCH_SOURCES, RuntimeConfig
from replay.evaluation.evidence import block_evidence
from replay.model.metrics import LayoutMetrics
from replay.model.metrics import StepTable
from replay.evaluation.stats import chance_misses, family_level, family_widening, repetition_interval, student_t_quantile

from .demo import measured_vs_predicted
from .render import MERGE_AGREES, completion_sentence, merge_sentence, small_page_warning
from .workdir import WorkDir

VALIDATION_FORMAT = "relayout.validation"
VALIDATION_VERSION = 12
OLDEST_JUDGED = 6
"""The oldest record version :func:`judge_record` judges again (it has the placement control,
the probes and the read-once rates)."""
LAYOUTS = ("stock", "louvain", "random")
"""Layouts a validation can measure; ``stock`` (the source itself) is the baseline of every saving."""
GATE_THRESHOLD = 0.05
"""The gate's threshold: the saving's interval low end must reach this fraction of the baseline TPOT."""
TOLERANCE = 0.20
"""The model holds when every cell's predicted/measured S is within this fraction of 1."""
PREFETCH_TOLERANCE = 0.30
"""A predicted prefetch saving agrees when within this fraction of the measured one (or inside its interval)."""
READS_AGREE = 0.10
"""The model's and the harness's demand drive reads per token agree within this fraction."""
DIAGNOSES = ("at_run_speed", "at_harness_compute", "less_page_cache_waits")
"""The diagnoses of a saving (keys of a comparison): the measured saving with each run brought to
the model's conditions, judged like the saving itself."""
HARNESS_EXCESS = 0.10
"""The harness's compute beyond the model's (a fraction of it) past which the verdict line says
whether the harness's own work explains the gap (:func:`harness_compute`)."""
FIRST_READ_SLOW = 0.75
"""A container whose first read runs below this fraction of the fastest one's rate is named in the summary."""
CLOSE_BAND = 0.10
"""The summary also counts the cells whose predicted/measured S is within this fraction of 1 (closer than the verdict's :data:`TOLERANCE`)."""
WORK_NAME = "relayout-validate"
WORK_MARKER = ".relayout-validate"
SYNTH_GEOMETRY = "glm-5.2-int4-row"
SYNTH_EXPERTS = 32
TRACE_SESSIONS = 17
PLACEMENT_COPY = "stock-copy"
"""A second rewrite of the stock plan, byte for byte the stock container's weights in the same order,
measured beside stock as a negative control: what the disk's placement of a file alone changes."""
TRAIN_FRACTION = 0.7
"""12 of 17 sessions train the plans, 5 are held out."""
HELD_OUT_SESSIONS = TRACE_SESSIONS - round(TRACE_SESSIONS * TRAIN_FRACTION)
SESSION_TOKENS = 60
DEFAULT_TOKENS = 40
DEFAULT_REPS = 4
"""Repetitions per cell unless ``--reps`` says otherwise: even, as :func:`measurement_order`
counterbalances the run order over pairs of repetitions (``MIN_REPS`` and ``MAX_REPS`` are even too)."""
MIN_TOKENS = 4
MIN_REPS = 2
VERDICT_REPS = 4
"""Repetitions per cell a verdict needs: with fewer, unless a measurement rules the model out even
so, the verdict is ``"insufficient"`` (over 2, a 95% interval is 12.7 standard errors either side,
and the family interval 42 times that at 42 judgements)."""
MAX_REPS = 10
PROBE_TOKENS = 10
PROBE_MARGIN = 1.3
"""A run is planned as this many times slower per step than the probe (the disk varies)."""
CALIBRATION_SECONDS = 0.2
CALIBRATION_MB = 512


@dataclass(frozen=True)
class ValidateOptions:
    """What ``relayout validate`` was asked to do (see the module doc). ``gb``: 10^9 bytes;
    ``minutes``: wall-clock budget of the whole run; ``ram``: fractions of the routed bytes."""

    path: Path
    output: Path
    device: str | None = None
    container: Path | None = None
    gb: float = 1.0
    minutes: float | None = None
    tokens: int | None = None
    reps: int | None = None
    layouts: tuple[str, ...] = LAYOUTS
    ram: tuple[float, ...] = (0.0, 0.25)
    prefetch: tuple[str, ...] = ("none",)
    workers: int = 8
    coalesce: bool = False
    plots: Path | None = None
    keep: bool = False
    seed: int = 0


def parse_list(text: str, what: str, kind=str) -> tuple:
    """``"a,b"`` -> ``("a", "b")`` (or numbers with ``kind=float``); one-line error naming ``what``."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise InputError(None, f"{what} needs at least one value")
    try:
        out = tuple(kind(x) for x in items)
    except ValueError:
        raise InputError(None, f"{what} expects comma-separated numbers, got {text!r}") from None
    if len(set(out)) != len(out):
        raise InputError(None, f"{what} lists a value twice: {text!r}")
    return out


def check_options(o: ValidateOptions) -> None:
    """Every option checked before anything is measured or written; one :class:`InputError` each."""
    if not o.path.is_dir():
        raise InputError(o.path, "is not a directory (give a directory on the disk to validate)")
    bad = [x for x in o.layouts if x not in LAYOUTS]
    if bad:
        raise InputError(None, f"--layouts: unknown layout {bad[0]!r} (choose from {', '.join(LAYOUTS)})")
    if "stock" not in o.layouts:
        raise InputError(None, "--layouts must include stock (the baseline every saving is measured against)")
    bad = [x for x in o.prefetch if x not in PREFETCH_SOURCES]
    if bad:
        raise InputError(None, f"--prefetch: unknown source {bad[0]!r} (choose from {', '.join(PREFETCH_SOURCES)})")
    bad = [x for x in o.ram if not (math.isfinite(x) and 0 <= x <= 1)]
    if bad:
        raise InputError(None, f"--ram: budgets are fractions of the routed bytes, 0 to 1 (got {bad[0]:g})")
    if o.reps is not None and not MIN_REPS <= o.reps <= 1000:
        raise InputError(None, f"--reps must be {MIN_REPS} to 1000 (a measured interval needs repeated runs), got {o.reps}")
    if o.tokens is not None and o.tokens < MIN_TOKENS:
        raise InputError(None, f"--tokens must be at least {MIN_TOKENS}, got {o.tokens}")
    if o.minutes is not None:
        if not (math.isfinite(o.minutes) and o.minutes > 0):
            raise InputError(None, f"--minutes must be a positive number, got {o.minutes:g}")
        if o.tokens is not None and o.reps is not None:
            raise InputError(None, "--minutes chooses --reps and/or --tokens; with both given it has nothing to choose")
    if o.container is None and not (math.isfinite(o.gb) and 0 < o.gb <= 100_000):
        raise InputError(None, f"--gb must be a positive size in GB, got {o.gb:g}")
    if not 1 <= o.workers <= 16:
        raise InputError(None, f"--workers must be 1-16, got {o.workers}")
    parent = o.output.parent
    if not parent.is_dir():
        raise InputError(o.output, f"cannot be written: {parent} is not a directory")
    if o.plots is not None:
        plotting()


def plotting():
    """matplotlib's pyplot (Agg backend), or the one-line error naming the ``plots`` extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError(None, "--plots needs matplotlib: pip install 'relayout[plots]'") from None
    return plt


def synthetic_geometry(gigabytes: float):
    """GLM-5.2 int4-row with :data:`SYNTH_EXPERTS` full-size (18.9 MB) experts per layer and as
    many MoE layers as make about ``gigabytes`` GB (10^9 bytes) of routed experts (at least one)."""
    g = load_geometry(SYNTH_GEOMETRY)
    per_layer = SYNTH_EXPERTS * g.expert_bytes(g.moe_layers[0])
    layers = max(1, round(gigabytes * 1e9 / per_layer))
    return g.scaled(moe_layers=layers, experts=SYNTH_EXPERTS, vocab=4096, shard_bytes=500_000_000)


@dataclass(frozen=True)
class Prediction:
    """One cell predicted on the profile: its steps (:class:`replay.model.metrics.StepTable`), their
    summary (:class:`replay.formats.gatefile.LayoutMetrics`), and the demand preads that reach the drives
    per committed token (the model's page cache serves the rest)."""

    steps: StepTable
    summary: LayoutMetrics
    drive_reads_per_token: float


@dataclass
class Layouts:
    """What the cells are measured on: per method its container directory, replay layout and plan."""

    dirs: dict
    layouts: dict
    plans: dict


def validation_trace(container: Container, seed: int = 0, tokens: int | None = None):
    """The routing trace ``validate`` synthesises for ``container`` (``--seed``, ``--tokens``):
    :data:`TRACE_SESSIONS` sessions of planted co-activation cliques over its routed layers, each
    long enough for ``tokens`` held-out steps (default :data:`DEFAULT_TOKENS`)."""
    from .traces.synth import SynthParams, synth_trace

    cfg = container.config
    layers = [l for l in container.routed_layers if l < cfg.num_hidden_layers]
    per_session = max(SESSION_TOKENS, -(-(tokens or DEFAULT_TOKENS) // HELD_OUT_SESSIONS))
    return synth_trace(layers, cfg.n_routed_experts, cfg.num_experts_per_tok, per_session * TRACE_SESSIONS,
                       TRACE_SESSIONS, seed=seed + 5, params=SynthParams(clique_strength=0.8))


def _prepare(o: ValidateOptions, work: WorkDir, notify) -> tuple:
    """Container, manifest path, trace and the layouts (planned, rewritten). Returns
    ``(container dir, manifest dict, trace, Layouts, synthetic)``."""
    from replay.formats.planfile import load_plan, save_plan

    from .apply import apply_plan
    from .plan import make_plan, source_from_container

    synthetic = o.container is None
    if synthetic:
        geometry = synthetic_geometry(o.gb)
        src = work.path / f"source-{o.gb:g}gb-s{o.seed}"
        if not (src / MANIFEST_NAME).is_file():     # a kept previous source is complete once its manifest is written
            work.claim(src.name, src.name + ".partial")
            notify(f"building a synthetic {geometry.name} container of {len(geometry.moe_layers)} MoE layer(s) x "
                   f"{SYNTH_EXPERTS} experts in {src}")
            synth_container(src, geometry, seed=o.seed)
            write_manifest(build_manifest(Container.open(src)), src / MANIFEST_NAME)
        manifest_path = src / MANIFEST_NAME
    else:
        src = o.container
        Container.open(src).require_clean()
        if os.stat(src).st_dev != os.stat(o.path).st_dev:
            notify(f"warning: {src} is not on the file system of {o.path}: its stock layout is measured where it is, the "
                   "rewritten layouts under PATH")
        manifest_path = src / MANIFEST_NAME
        if not manifest_path.is_file():             # never written into the source: ours, in the work directory
            notify(f"{src} has no {MANIFEST_NAME}: hashing it once (kept in the work directory, the source is not modified)")
            manifest_path = work.claim("source-manifest.json")
            write_manifest(build_manifest(Container.open(src)), manifest_path)
    container = Container.open(src)
    from containers.manifest import load_manifest

    manifest = load_manifest(manifest_path)
    trace = validation_trace(container, o.seed, o.tokens)
    source = source_from_container(src, manifest_path)
    need = sum(p.stat().st_size for p in container.files)

    dirs, lays, plans, writes = {}, {}, {}, []
    for method in o.layouts:
        path = work.claim(f"plan-{method}.json")
        save_plan(make_plan(trace, source, method, train_fraction=TRAIN_FRACTION, seed=o.seed, progress=False), path)
        plan = load_plan(path)
        plans[method] = plan
        if method == "stock" and not synthetic:
            dirs[method], lays[method] = src, plan.stock
            continue
        lays[method] = plan.layout
        writes.append((method, plan))
    writes.append((PLACEMENT_COPY, plans["stock"]))
    free = shutil.disk_usage(work.path).free
    if free < need * len(writes) * 1.05:
        raise InputError(work.path, f"needs {need * len(writes) / 1e9:.1f} GB free for {len(writes)} rewritten containers, "
                                    f"has {free / 1e9:.1f} GB")
    for name, _ in writes:
        dirs[name] = work.claim(f"layout-{name}", f"layout-{name}.partial")
    notify(f"rewriting {src} into {', '.join(name for name, _ in writes)} ({work.path}/layout-*), all at once: on a disk "
           "that serves files by the order they were written, no container is then written before the others")

    def rewrite(job: tuple) -> None:
        name, plan = job
        apply_plan(src, plan, dirs[name], None, force=True, manifest_path=manifest_path, progress=False)

    with ThreadPoolExecutor(len(writes)) as pool:
        list(pool.map(rewrite, writes))
    return src, manifest, trace, Layouts(dirs, lays, plans), synthetic


def _cells(o: ValidateOptions) -> list[tuple]:
    """(prefetch, ram fraction) pairs, in the order the record lists the cells."""
    return [(pf, frac) for pf in o.prefetch for frac in o.ram]


def measurement_order(runs: list, rep: int, block: int) -> list:
    """The order the ``runs`` of one block (every layout x prefetch source at one RAM budget) take
    their first step in, repetition ``rep`` (:func:`replay.physical.measure.measure_interleaved` then
    rotates it by one place each step): rotated by one place per pair of repetitions and per block,
    and reversed in the second repetition of each pair (ABBA counterbalancing). Over a pair every
    run's mean place in the block is the same, so a disk whose speed drifts steadily within a
    round (a throttled cloud volume, this machine's virtual disk) favours no side of any saving,
    layout or prefetch source; with an odd number of repetitions the last one is unpaired (seed
    9.2: configuration order balanced)."""
    k = (rep // 2 + block) % len(runs)
    order = list(runs[k:]) + list(runs[:k])
    return order[::-1] if rep % 2 else order


def _step_order(m, fw: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
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


def _choose_size(o: ValidateOptions, available: int, n_runs_per_rep: int, probe_seconds: float, probe_steps: int,
                 budget_s: float) -> tuple[int, int, str]:
    """``(tokens, reps, what was chosen and why)`` for a measurement budget of ``budget_s`` seconds."""
    per_step = PROBE_MARGIN * probe_seconds / max(probe_steps, 1)   # s per measured step, the slowest cell
    steps_fit = int(budget_s / max(per_step, 1e-9))           # measured steps that fit, over all runs
    if o.reps is not None:
        reps = o.reps
        tokens = min(available, steps_fit // (reps * n_runs_per_rep))
    elif o.tokens is not None:
        tokens = min(o.tokens, available)
        reps = min(MAX_REPS, steps_fit // (tokens * n_runs_per_rep) // 2 * 2)
    else:
        # DEFAULT_REPS (what a verdict needs, VERDICT_REPS) unless a run would get fewer than
        # MIN_TOKENS steps: the repetitions are the interval's units, and 2 of them give it one
        # degree of freedom, too few for a verdict
        reps = DEFAULT_REPS
        tokens = min(available, steps_fit // (reps * n_runs_per_rep))
        if tokens < min(MIN_TOKENS, available):
            reps = MIN_REPS
            tokens = min(available, steps_fit // (reps * n_runs_per_rep))
        if tokens >= available:                # an even count: the order is counterbalanced in pairs
            reps = min(MAX_REPS, max(MIN_REPS, steps_fit // (tokens * n_runs_per_rep) // 2 * 2))
    over = ""
    if tokens < MIN_TOKENS or reps < MIN_REPS:
        tokens, reps = max(tokens, MIN_TOKENS), max(reps, MIN_REPS)
        over = " (the smallest run allowed; it will take longer than --minutes)"
    est = per_step * tokens * reps * n_runs_per_rep
    why = (f"--minutes {o.minutes:g}: a probe measured {probe_steps} steps in {probe_seconds:.2f} s "
           f"(planned at {per_step * 1e3:.0f} ms/step, x{PROBE_MARGIN:g} for safety); chose {reps} repetitions x {tokens} steps x {n_runs_per_rep} runs, "
           f"about {est / 60:.1f} min of measurement{over}"
           + (f"; fewer repetitions than the {VERDICT_REPS} a verdict needs: its answer will be 'insufficient' unless a "
              "measurement rules the model out" if reps < VERDICT_REPS else ""))
    return tokens, reps, why


def validate(o: ValidateOptions, notify=print, progress: bool = True) -> dict:
    """Run the validation (see the module doc) and return the ``validation.json`` record, written to ``o.output``."""
    from replay.physical.calibrate import calibrate, merge_saving, probe_rate
    from replay.model.device import load_device
    from replay.model.engine import simulate
    from replay.evaluation.gate import evaluation_forwards, training_coupling
    from replay.physical.measure import Arm, measure, measure_interleaved
    from replay.model.metrics import drive_rate, step_table, summarize
    from replay.physical.stalltrace import report

    t_start = time.perf_counter()
    check_options(o)
    device_source, profile_path, sharing, merge = None, None, None, None
    if o.device:
        device = load_device(o.device)
        device_source = f"given: {o.device}"
    work = WorkDir.open(o.path / WORK_NAME, WORK_MARKER, "validate")
    try:
        src, manifest, trace, lay, synthetic = _prepare(o, work, notify)
        first_read = _read_each_once(lay.dirs, progress)
        if not o.device:
            target = calibration_target(lay.dirs["stock"], o.path)
            notify(f"calibrating the disk holding {o.path} on {target} ({CALIBRATION_SECONDS:g} s per cell"
                   + (f", {CALIBRATION_MB} MiB test file)" if target.is_dir() else ", reading it only)"))
            profile = calibrate(target, CALIBRATION_MB, CALIBRATION_SECONDS, f"calibrated-{o.path.resolve().name or 'disk'}")
            profile_path = o.output.with_name(o.output.stem + ".device.json")
            write_json_atomic(profile_path, profile)
            device = load_device(str(profile_path))
            device_source = f"calibrated on {target}, saved as {profile_path}"
            notify(f"wrote {profile_path}")
            sharing, merge = completion_sentence(profile), merge_sentence(profile)
            notes = [small_page_warning(profile), sharing[0] if sharing and sharing[1] else None,
                     merge[0] if merge and (merge[1] is None or abs(merge[1] - 1) > MERGE_AGREES) else None]
            for sentence in filter(None, notes):
                notify(sentence[0].upper() + sentence[1:])
        plans = list(lay.plans.values())
        mask_all, held = evaluation_forwards(trace, plans)
        available = int(mask_all.sum())
        stock_plan = lay.plans["stock"]
        layers = set(trace.layers.tolist())
        ebytes = stock_plan.stock.expert_bytes()
        routed = int(sum(ebytes[li].sum() for li, l in enumerate(stock_plan.stock.layers) if l in layers))
        coupling = training_coupling(trace, stock_plan) if "coupled" in o.prefetch else None
        base_cfg = RuntimeConfig(workers=o.workers, coalesce=o.coalesce)
        cells = _cells(o)
        control_pf = "none" if "none" in o.prefetch else o.prefetch[0]   # the placement control's prefetch source
        n_runs = len(cells) * len(o.layouts) + len(o.ram)                # + the placement control in every block

        def config_of(pf: str, frac: float) -> RuntimeConfig:
            return replace(base_cfg, ram_bytes=int(routed * frac), prefetch=pf)

        def first(n: int) -> np.ndarray:
            return mask_all & (np.cumsum(mask_all) <= n)

        run_dir = make_dirs(work.claim("runs"))
        chosen = None
        tokens = min(o.tokens or DEFAULT_TOKENS, available)
        reps = o.reps or DEFAULT_REPS
        if o.minutes is not None:
            pf, frac = min(cells, key=lambda c: c[1])
            probe_steps = min(PROBE_TOKENS, available)
            # the replay model compiles on a machine's first run: do it now, so the budget counts it
            simulate(trace, first(probe_steps), lay.layouts["stock"], device, config_of(pf, frac), coupling=coupling)
            notify(f"probing: {probe_steps} steps of stock at RAM {frac:g}, prefetch {pf}")
            res = measure(Container.open(lay.dirs["stock"]), trace, first(probe_steps), config_of(pf, frac), None,
                          record=False, progress=False, coupling=coupling)
            budget = o.minutes * 60 - (time.perf_counter() - t_start)
            budget -= max(15.0, 0.1 * budget)       # predictions, evidence, writing, removing the work directory
            tokens, reps, chosen = _choose_size(o, available, n_runs, res.wall_seconds, probe_steps, budget)
            notify(chosen)
        if reps % 2:
            notify(f"{reps} repetitions: the last is unpaired, so a disk whose speed drifts through a round is not "
                   "fully counterbalanced (an even --reps is)")
        if o.tokens is not None and o.tokens > available:
            notify(f"only {available} held-out steps in the trace: measuring {available}, not {o.tokens}")
        mask = first(tokens)
        fw = np.flatnonzero(mask)
        methods = list(o.layouts)
        probe_file, probe_size = _probe_target(lay.dirs["stock"], lay.layouts["stock"])
        rates = [probe_rate(probe_file, probe_size, o.workers)] if probe_file else []

        # predictions: exactly the measured steps, on the profile
        predicted = {}
        for pf, frac in cells:
            cfg = config_of(pf, frac)
            for m in methods:
                inst, usage = simulate(trace, mask, lay.layouts[m], device, cfg, coupling=coupling)
                steps = step_table(trace, mask, inst)
                predicted[(m, pf, frac)] = Prediction(steps, summarize(steps, usage, 0.0),
                                                      float(inst.drive_reads.sum() / steps.committed.sum()))

        # measurements: cold, the layouts and prefetch sources of a RAM budget in lockstep within each repetition
        measured = {(m, pf, frac): [] for pf, frac in cells for m in methods}
        control = {frac: [] for frac in o.ram}       # S of the stock copy per repetition (s/token)
        run_order = []                               # ((layout, prefetch, RAM fraction), repetition, block), as measured
        bar = progress_bar(total=reps * n_runs * len(fw), desc="validate: measured steps", unit="step",
                           enabled=progress)
        try:
            block_runs = [(m, pf) for m in methods for pf in o.prefetch]
            for rep in range(reps):
                for bi, frac in enumerate(o.ram):
                    block = measurement_order(block_runs, rep, bi)
                    arms = []
                    for m, pf in block:
                        run_id = f"{m}-ram{frac:g}-{pf}-rep{rep}"
                        arms.append(Arm(Container.open(lay.dirs[m]), config_of(pf, frac), run_dir / f"{run_id}.jsonl",
                                        run_id=run_id, coupling=coupling))
                    run_id = f"{PLACEMENT_COPY}-ram{frac:g}-{control_pf}-rep{rep}"
                    arms.append(Arm(Container.open(lay.dirs[PLACEMENT_COPY]), config_of(control_pf, frac),
                                    run_dir / f"{run_id}.jsonl", run_id=run_id))
                    results = measure_interleaved(arms, trace, mask, progress=False, on_step=lambda: bar.update(1))
                    copy_arm, copy_res = arms.pop(), results.pop()
                    control[frac].append(copy_res.stall_ns / 1e9 / max(copy_res.committed, 1))
                    if not o.keep:
                        copy_arm.out.unlink()
                    for (m, pf), arm, res in zip(block, arms, results):
                        run_order.append(((m, pf, frac), rep, (rep, bi)))
                        out = arm.out
                        r = report([out])
                        run = r.runs[0]
                        stall, committed = _step_order(run, fw, str(out))
                        measured[(m, pf, frac)].append({
                            "stall": stall / 1e9, "committed": committed, "wall_s": res.wall_seconds,
                            "tpot_s": (run.published["tpot_ns"] or 0.0) / 1e9,
                            "compute_s": (run.published["compute_per_committed_token_ns"] or 0.0) / 1e9,
                            "recall": run.published["timely_required_byte_recall"], "cold": res.cold, "direct": res.direct,
                            "drive_rate_Bps": run.drive_rate_Bps,
                            "page_cache_wait_s": None if run.page_cache_wait_ns is None else run.page_cache_wait_ns / 1e9,
                            "drive_reads_per_token": (run.published["reads"] or {}).get("demand", {}).get(
                                "drive_requests_per_committed_token"),
                        })
                        if not o.keep:
                            out.unlink()
                if probe_file:
                    rates.append(probe_rate(probe_file, probe_size, o.workers, seed=rep + 1))
        finally:
            bar.close()
        merge_after = None
        merge_size = profile["calibration"]["merge"]["size"] if merge else 0
        if merge and probe_file and probe_file.stat().st_size >= 2 * merge_size + 4096:
            merge_after = merge_saving(probe_file, merge_size)  # what merging saves now, beside what it saved before
            merge = merge_after_sentence(merge, merge_after)

        def stall_and_rate(key: tuple, device_at) -> tuple[float, float | None]:
            """S (s/token) predicted for cell ``key`` on ``device_at``, and the rate its drives ran at."""
            m, pf, frac = key
            inst, usage = simulate(trace, mask, lay.layouts[m], device_at, config_of(pf, frac), coupling=coupling)
            return summarize(step_table(trace, mask, inst), usage, 0.0).stall_per_token_s, drive_rate(usage, device_at)

        keys = [(m, pf, frac) for pf, frac in cells for m in methods]
        drift, probed = None, {}
        if probe_file:
            drift = _drift(probe_file, probe_size, o.workers, rates, device)
            probed = {k: [stall_and_rate(k, device.scaled(f))[0] for f in drift["scales"]] for k in keys}
        at_run = {k: [at_run_speed(partial(stall_and_rate, k), device, r["drive_rate_Bps"]) for r in measured[k]]
                  for k in keys}
        near = neighbour_scales([at_run[k][r]["scale"] if at_run[k][r] else None for k, r, _ in run_order],
                                [g for _, _, g in run_order])
        at_near = {k: [None] * len(measured[k]) for k in keys}
        for (k, r, _), f in zip(run_order, near):
            if f is not None:
                at_near[k][r] = {"scale": f, "predicted_stall_per_token_s": stall_and_rate(k, device.scaled(f))[0]}

        def stall_at_compute(key: tuple, scale: float, rate: float) -> tuple[float, float]:
            """S and compute (s/token) predicted for cell ``key`` on the profile scaled by ``scale``
            with matmuls at ``rate`` bytes/s."""
            m, pf, frac = key
            cfg = replace(config_of(pf, frac), compute_bytes_per_second=rate)
            inst, usage = simulate(trace, mask, lay.layouts[m], device.scaled(scale), cfg, coupling=coupling)
            summ = summarize(step_table(trace, mask, inst), usage, 0.0)
            return summ.stall_per_token_s, summ.compute_per_token_s

        at_harness = {}                              # each run at its own drive's speed and with its own compute
        for k in keys:
            rate = base_cfg.compute_bytes_per_second
            compute = predicted[k].summary.compute_per_token_s
            matmul = stall_at_compute(k, 1.0, rate / 2)[1] - compute   # compute is dense + matmul bytes / rate
            at_harness[k] = []
            for run, a in zip(measured[k], at_run[k]):
                x = None if a is None else at_harness_compute(
                    lambda r, k=k, f=a["scale"]: stall_at_compute(k, f, r)[0], rate, compute, matmul, run["compute_s"])
                at_harness[k].append(None if x is None else {**x, "scale": a["scale"]})

        record = _record(o, device, device_source, profile_path, src, manifest, trace, held, lay, synthetic, routed,
                         base_cfg, tokens, reps, chosen, cells, methods, predicted, measured, fw, drift, probed, first_read,
                         at_run, at_near, at_harness, sharing, merge, merge_after, (control_pf, control))
        record["work_dir"] = str(work.path) if o.keep else None
        record["plots"] = [str(p) for p in write_validation_plot(record, o.plots)] if o.plots is not None else []
        record["elapsed_seconds"] = round(time.perf_counter() - t_start, 3)
        write_json_atomic(o.output, record)
        return record
    finally:
        if o.keep:
            work.seal()
        else:
            for line in work.remove():
                notify(line)


def calibration_target(container_dir: Path, path: Path) -> Path:
    """What ``validate`` calibrates on: the largest safetensors file of the stock container
    (only read), once every container has been read once, when it lies on the file system of
    ``path`` and holds the calibration's largest reads; else ``path``, where a test file is
    written. The runs then read data the calibration read too, in the same state: this VM's disk
    read a freshly written test file at other speeds than the containers read once before
    (2026-12-02, two runs: each run's disk 0.91-1.70 times as fast as the test-file profile)."""
    from replay.physical.calibrate import MIN_FILE_BYTES

    files = sorted(Path(container_dir).glob("*.safetensors"), key=lambda p: p.stat().st_size)
    if files and files[-1].stat().st_size >= MIN_FILE_BYTES and os.stat(files[-1]).st_dev == os.stat(path).st_dev:
        return files[-1]
    return Path(path)


def _read_each_once(dirs: dict, progress: bool) -> dict:
    """Read every file of each layout's container once (:func:`replay.physical.calibrate.read_once`),
    before anything is measured, so no layout is measured on blocks read for the first time.
    Returns per layout ``{"bytes", "seconds", "rate_Bps"}``: containers read at very different
    rates show a disk that does not serve every file alike on a first read
    (:func:`summarize_validation` names the slow ones)."""
    from replay.physical.calibrate import read_once

    files = {m: sorted(p for p in Path(d).iterdir() if p.is_file()) for m, d in dirs.items()}
    total = sum(p.stat().st_size for fs in files.values() for p in fs)
    out = {}
    with progress_bar(total=total, desc="validate: reading each container once", unit="B", unit_scale=True,
                      enabled=progress) as bar:
        for m, fs in files.items():
            n, seconds = read_once(fs, bar.update)
            out[m] = {"bytes": n, "seconds": seconds, "rate_Bps": n / seconds if seconds > 0 else None}
    return out


def _probe_target(container_dir: Path, stock) -> tuple[Path | None, int]:
    """The drift probe's file (the container's largest) and read size (bytes): the median
    expert's bytes, aligned up, as the measured forwards read them (at most half the file)."""
    from replay.physical.calibrate import ALIGN

    files = sorted(Path(container_dir).glob("*.safetensors"), key=lambda p: p.stat().st_size)
    expert = -(-int(np.median(stock.expert_bytes())) // ALIGN) * ALIGN
    size = min(expert, files[-1].stat().st_size // 2 // ALIGN * ALIGN) if files else 0
    return (files[-1], size) if size >= ALIGN else (None, 0)


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

    The harness emulates the runtime's compute (:class:`replay.physical.measure._ComputeClock`); its own
    Python work (routing, submitting reads, records, waking) is taken off the emulated compute
    while it fits in it. A harness that counted the work beyond as compute between a layer's
    reads overlapped them with it and measured less stall, the more so for layouts issuing more
    reads (``docs/BENCHMARKS.md``, v29-v33); the present one times its waits in the compute
    model's time (:meth:`replay.physical.measure._ComputeClock.waited`), and what excess is left falls
    outside a layer's reads. Here the run's excess, ``measured_compute - compute``, is given to
    the model as slower matmuls, at ``rate * matmul / (matmul + excess)``: the prediction the
    first kind of harness should be held to, and for the present one a check that the excess is
    small and alike across layouts.

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


def _drift(probe_file: Path, probe_size: int, depth: int, rates: list[float], device) -> dict:
    """The disk's probed rate before the first repetition and after each (bytes/s), and each
    repetition's speed against the profile's: the mean of the probes around it over the rate the
    profile gives the probe's reads (:meth:`replay.model.device.ArrayProfile.steady_rate`)."""
    from replay.physical.calibrate import PROBE_SECONDS

    profile_rate = device.steady_rate(probe_size, depth)
    scales = [(rates[r] + rates[r + 1]) / 2 / profile_rate for r in range(len(rates) - 1)]
    return {"probe": {"file": str(probe_file), "size_bytes": probe_size, "depth": depth, "seconds": PROBE_SECONDS},
            "rates_Bps": rates, "profile_rate_Bps": profile_rate, "scales": scales,
            "change": max(rates) / min(rates) - 1}


def _interval(ev) -> dict:
    est, low, high = ev.interval()
    return {"estimate_s": est, "low_s": low, "high_s": high, "method": ev.method, "block_steps": ev.block_steps,
            "units": len(ev.base), "blocks": ev.n_blocks, "seed": ev.seed, "resamples": ev.resamples}


def _over_repetitions(values: list[float], judgements: int | None = None) -> dict:
    """A measured figure's mean and 95% interval with each repetition one unit (s/token); with
    ``judgements``, also its ``family`` interval: at the coverage each of the run's judgements
    needs for all of them to hold together 95% of the time (:func:`replay.evaluation.stats.family_level`),
    the one a prediction must miss to be ruled out."""
    iv = repetition_interval(values)
    out = {"estimate_s": iv.estimate, "low_s": iv.low, "high_s": iv.high, "method": "repetitions (Student t)",
           "units": iv.n_units}
    if judgements is not None:
        level = family_level(judgements)
        fam = repetition_interval(values, level=level)
        out["family"] = {"level": level, "judgements": judgements, "low_s": fam.low, "high_s": fam.high}
    return out


def cell_agreement(predicted: float, mean: float, low: float, high: float, tolerance: float = TOLERANCE) -> str:
    """``"agrees"`` when predicted S is within ``tolerance`` of the measured mean; ``"disagrees"``
    when it lies outside the measured interval [``low``, ``high``] widened by ``tolerance`` (no S
    the measurement admits is within tolerance of the prediction; ``validate`` passes the cell's
    family interval, :func:`_over_repetitions`); else ``"unresolved"`` (the repetitions scatter
    too widely to tell). Any one unit (s/token)."""
    if mean > 0 and abs(predicted / mean - 1) <= tolerance:
        return "agrees"
    if predicted > high * (1 + tolerance) or predicted < max(low, 0.0) * (1 - tolerance):
        return "disagrees"
    return "unresolved"


def resolves_tolerance(m: dict, tolerance: float) -> bool:
    """Whether a measured saving (``m``: estimate and 95% interval, s/token) is precise enough to
    judge a prediction to within ``tolerance`` of it: the interval's half-width is at most that
    fraction of the estimate's size. Where it is not, even a perfect prediction lands outside
    the tolerance of the measured estimate about as often as inside."""
    return (m["high_s"] - m["low_s"]) / 2 <= tolerance * abs(m["estimate_s"])


def _judge(predicted_s: float, m: dict, tolerance: float | None = None, placement_s: float | None = None) -> dict:
    """How a predicted saving (s/token) stands against a measured one (``m``: estimate, 95%
    interval and, from :func:`judge_record`, the ``family`` interval, :func:`_over_repetitions`).
    ``agreement``, from nearest to farthest:

    * ``"agrees"``: the prediction lies inside the measured 95% interval (or, with ``tolerance``,
      within that fraction of the measured estimate);
    * ``"unresolved"``: outside it, but inside the family interval (with ``tolerance``, widened
      so that it holds every prediction within that fraction of a saving the family interval
      admits): one 95% interval in twenty misses by chance, and a run judges many;
    * ``"within placement"`` (with ``placement_s``, for a saving between two containers: how far
      the placement control admits that where the disk put two byte-identical files moves S,
      :func:`placement_bound`): beyond that, but inside it widened by ``placement_s`` on each
      side: the measurement cannot tell the difference from placement;
    * ``"disagrees"``: beyond all of these: the measurement rules the prediction out. A
      prediction of the other sign than the measured interval is ruled out only so: a 95%
      interval clear of zero is itself one of the judgements chance may miss.
    """
    low, high = m["low_s"], m["high_s"]
    fam = m.get("family", {"low_s": low, "high_s": high, "level": 0.95, "judgements": 1})
    tol = tolerance or 0.0
    flo, fhi = fam["low_s"] - tol * abs(fam["low_s"]), fam["high_s"] + tol * abs(fam["high_s"])
    b = placement_s or 0.0
    excludes = low > 0 or high < 0
    sign = bool(np.sign(predicted_s) == np.sign(m["estimate_s"])) if excludes else None
    inside = bool(low <= predicted_s <= high)
    close = tolerance is not None and abs(predicted_s - m["estimate_s"]) <= tolerance * abs(m["estimate_s"])
    words = measured_vs_predicted(m["estimate_s"] * 1e3, low * 1e3, high * 1e3, predicted_s * 1e3)
    said = (f"measured {m['estimate_s'] * 1e3:+.3f} [{low * 1e3:+.3f}, {high * 1e3:+.3f}], predicted "
            f"{predicted_s * 1e3:+.3f}: outside the 95% interval but ")
    family = (f"the {fam['level']:.2%} one [{fam['low_s'] * 1e3:+.3f}, {fam['high_s'] * 1e3:+.3f}] that each of this "
              f"run's {fam['judgements']} judgements needs for all to hold together 95% of the time"
              + (f" (widened by the +/-{tol:.0%} tolerance)" if tol else ""))
    if inside or close:
        agreement = "agrees"
    elif flo <= predicted_s <= fhi:
        agreement = "unresolved"
        words = said + "inside " + family + ": as often as chance misses, so neither confirmed nor ruled out"
    elif b > 0 and flo - b <= predicted_s <= fhi + b:
        agreement = "within placement"
        words = (said + "also beyond " + family + f", by no more than two byte-identical copies of stock differ (the "
                 f"placement control: up to {b * 1e3:.3f}): this measurement neither confirms nor rules out the prediction")
    else:
        agreement = "disagrees"
    out = {"predicted_inside_measured": inside, "measured_excludes_zero": bool(excludes), "sign_agrees": sign,
           "agreement": agreement, "words": words + " (ms/token)"}
    if tolerance is not None:
        out["within_tolerance"] = bool(close)
    if placement_s is not None:
        out["placement_bound_s"] = placement_s
    return out


def _saving(base_pred, new_pred, base_runs: list[dict], runs: list[dict]) -> dict:
    """Predicted and measured saving of ``new`` over ``base`` (s/token): the prediction paired by
    step (moving-block bootstrap over the held-out steps), the measurement paired by repetition (each
    repetition measures both, interleaved step by step: one unit each)."""
    p = _interval(block_evidence(base_pred.stall, new_pred.stall, base_pred.committed, base_pred.session))
    each = [float((b["stall"].sum() - n["stall"].sum()) / b["committed"].sum()) for b, n in zip(base_runs, runs)]
    return {"predicted_saving": p, "measured_saving": {**_over_repetitions(each), "repetitions": each}}


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


def _run_stalls(runs: list[dict]) -> list[float]:
    """Each measured run's S (s/token)."""
    return [float(r["stall"].sum() / r["committed"].sum()) for r in runs]


def _page_cache_waits(runs: list[dict]) -> list[float] | None:
    """Each measured run's stall on experts whose own reads the page cache served (s/token,
    :func:`replay.physical.stalltrace.page_cache_wait`); None when a run's records carry no I/O counts."""
    if any(r.get("page_cache_wait_s") is None for r in runs):
        return None
    return [float(r["page_cache_wait_s"] / r["committed"].sum()) for r in runs]


def _normalized_saving(base: tuple, new: tuple) -> dict | None:
    """The measured saving with each run brought to the model's conditions
    (:func:`speed_normalized_savings`) over the repetitions, which :func:`judge_record` judges
    the prediction against: a diagnosis beside the plain comparison, which the verdict rests on.
    ``base``, ``new``: (measured S per repetition, S predicted as configured, per repetition the
    run's own prediction: :func:`at_run_speed` for equal disk speed, :func:`at_harness_compute`
    for the compute the harness ran)."""
    (bm, bp, ba), (nm, npred, na) = base, new
    if not ba or not na or any(x is None or x["predicted_stall_per_token_s"] <= 0 for x in ba + na):
        return None
    each = speed_normalized_savings(bm, bp, [x["predicted_stall_per_token_s"] for x in ba],
                                    nm, npred, [x["predicted_stall_per_token_s"] for x in na])
    return {"measured": {**_over_repetitions(each), "repetitions": each}}


def _predicted_at(entries: list, measured_mean: float) -> dict | None:
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


def _record(o, device, device_source, profile_path, src, manifest, trace, held, lay, synthetic, routed, base_cfg, tokens,
            reps, chosen, cells, methods, predicted, measured, fw, drift, probed, first_read, at_run, at_near,
            at_harness, sharing, merge, merge_after, control) -> dict:
    out_cells, comparisons, prefetch_comparisons = [], [], []
    control_pf, copies = control
    placement = {"prefetch": control_pf, "blocks": [
        placement_difference(frac, _run_stalls(measured[("stock", control_pf, frac)]), copy_s)
        for frac, copy_s in copies.items()]}

    def side(key: tuple, at: dict) -> tuple:         # one side of a normalized saving (_normalized_saving)
        return _run_stalls(measured[key]), predicted[key].summary.stall_per_token_s, at[key]

    def less_cache_waits(key: tuple, waits: list[float]) -> tuple:   # one side at equal disk speed, less its waits
        return ([s - w for s, w in zip(_run_stalls(measured[key]), waits)], predicted[key].summary.stall_per_token_s,
                at_run[key])

    def normalized(base: tuple, new: tuple) -> dict:
        waits = _page_cache_waits(measured[base]), _page_cache_waits(measured[new])
        return {"at_run_speed": _normalized_saving(side(base, at_run), side(new, at_run)),
                "at_harness_compute": _normalized_saving(side(base, at_harness), side(new, at_harness)),
                "less_page_cache_waits": None if None in waits else
                _normalized_saving(less_cache_waits(base, waits[0]), less_cache_waits(new, waits[1]))}

    for pf, frac in cells:
        for m in methods:
            steps, summ = predicted[(m, pf, frac)].steps, predicted[(m, pf, frac)].summary
            runs = measured[(m, pf, frac)]
            each = _run_stalls(runs)
            iv = _over_repetitions(each)
            mean = iv["estimate_s"]
            pred = summ.stall_per_token_s
            adjusted = None
            if drift is not None:
                each_pred = probed[(m, pf, frac)]
                adjusted = {"predicted_stall_per_token_s": each_pred,
                            "ratio": float(np.mean(each_pred)) / mean if mean > 0 else None}
            run_speed, near_speed, harness = (_predicted_at(x[(m, pf, frac)], mean) for x in (at_run, at_near, at_harness))
            waits = _page_cache_waits(runs)
            recall = None
            if pf != "none":
                recall = {"predicted": summ.prefetch.timely_required_byte_recall if summ.prefetch else None,
                          "measured": [r["recall"] for r in runs]}
            out_cells.append({
                "layout": m, "ram_fraction": frac, "ram_bytes": int(routed * frac), "prefetch": pf,
                "predicted_stall_per_token_s": pred,
                "predicted_oracle_stall_per_token_s": summ.oracle_stall_per_token_s,
                "predicted_tpot_s": summ.tpot_s,
                "measured_stall_per_token_s": {"mean": mean, "repetitions": each, "low": iv["low_s"], "high": iv["high_s"],
                                               "interval": iv["method"]},
                "measured_tpot_s": {"mean": float(np.mean([r["tpot_s"] for r in runs])), "repetitions": [r["tpot_s"] for r in runs]},
                "predicted_compute_per_token_s": summ.compute_per_token_s,
                "measured_compute_per_token_s": {"mean": float(np.mean([r["compute_s"] for r in runs])),
                                                 "repetitions": [r["compute_s"] for r in runs]},
                "measured_wall_seconds": [r["wall_s"] for r in runs],
                "measured_page_cache_wait_per_token_s": None if waits is None else
                {"mean": float(np.mean(waits)), "repetitions": waits},
                "predicted_drive_reads_per_token": predicted[(m, pf, frac)].drive_reads_per_token,
                "measured_drive_reads_per_token": None if any(r["drive_reads_per_token"] is None or not r["direct"]
                                                              for r in runs) else
                {"mean": float(np.mean([r["drive_reads_per_token"] for r in runs])),
                 "repetitions": [r["drive_reads_per_token"] for r in runs]},
                "ratio": pred / mean if mean > 0 else None,
                "at_probed_speed": adjusted,
                "at_run_speed": run_speed,
                "at_neighbour_speed": near_speed,
                "at_harness_compute": harness,
                "timely_required_byte_recall": recall,
            })
        base_steps, base_sum = predicted[("stock", pf, frac)].steps, predicted[("stock", pf, frac)].summary
        base_runs = measured[("stock", pf, frac)]
        for m in methods:
            if m == "stock":
                continue
            x = _saving(base_steps, predicted[(m, pf, frac)].steps, base_runs, measured[(m, pf, frac)])
            p, mm = x["predicted_saving"], x["measured_saving"]
            x.update(normalized(("stock", pf, frac), (m, pf, frac)))
            tpot_p = base_sum.tpot_s
            tpot_m = float(np.mean([r["tpot_s"] for r in base_runs]))
            gate_p = p["low_s"] >= GATE_THRESHOLD * tpot_p
            gate_m = mm["low_s"] >= GATE_THRESHOLD * tpot_m
            comparisons.append({
                "layout": m, "baseline": "stock", "ram_fraction": frac, "prefetch": pf, **x,
                "gate": {"threshold": GATE_THRESHOLD,
                         "predicted": {"tpot_s": tpot_p, "need_s": GATE_THRESHOLD * tpot_p, "passes": bool(gate_p)},
                         "measured": {"tpot_s": tpot_m, "need_s": GATE_THRESHOLD * tpot_m, "passes": bool(gate_m)},
                         "same_decision": bool(gate_p == gate_m)},
            })
    if "none" in o.prefetch:
        for pf, frac in cells:
            if pf == "none":
                continue
            for m in methods:
                # the plain saving over repetitions: no layer of a forward is beyond a prefetch source's reach to
                # serve as a drift control (the runtime queues layer L+1's loads when L is routed, the first's too)
                x = _saving(predicted[(m, "none", frac)].steps, predicted[(m, pf, frac)].steps, measured[(m, "none", frac)],
                            measured[(m, pf, frac)])
                x.update(normalized((m, "none", frac), (m, pf, frac)))
                prefetch_comparisons.append({"layout": m, "ram_fraction": frac, "prefetch": pf, "baseline": "none",
                                             "tolerance": PREFETCH_TOLERANCE, **x})
    cold = sorted({r["cold"] for runs in measured.values() for r in runs})
    return judge_record({
        "format": VALIDATION_FORMAT,
        "version": VALIDATION_VERSION,
        "tool_version": __version__,
        "path": str(o.path),
        "device": {"name": device.name, "digest": device.digest(), "source": device_source,
                   "profile_path": str(profile_path) if profile_path else None, "profile": device.to_json()},
        "container": {"path": str(src), "synthetic": synthetic, "fingerprint": manifest["fingerprint"],
                      "content_fingerprint": manifest["content_fingerprint"], "routed_bytes": routed,
                      "layers": [int(x) for x in trace.layers.tolist()], "experts": int(trace.n_experts),
                      "gb_requested": o.gb if synthetic else None},
        "trace": {"synthetic": True, "fingerprint": trace.fingerprint(), "sessions": len(trace.sessions),
                  "train_fraction": TRAIN_FRACTION, "held_out_sessions": [trace.sessions[i] for i in held.evaluated],
                  "steps": len(fw), "first_forward": int(fw[0]), "last_forward": int(fw[-1]),
                  "committed_tokens": int(trace.fwd_committed[fw].sum())},
        "layouts": {m: {"plan_digest": p.digest, "method": p.method,
                        "container": "the source" if m == "stock" and not synthetic else "rewritten copy"}
                    for m, p in lay.plans.items()},
        "config": {"tokens": len(fw), "reps": reps, "layouts": list(methods), "ram_fractions": list(o.ram),
                   "prefetch": list(o.prefetch), "workers": o.workers, "minutes": o.minutes, "chosen": chosen,
                   "runtime": base_cfg.to_json(), "gate_threshold": GATE_THRESHOLD, "tolerance": TOLERANCE,
                   "cache": cold, "seed": o.seed},
        "drift": drift,
        "first_read": first_read,
        "cells": out_cells,
        "comparisons": comparisons,
        "prefetch_comparisons": prefetch_comparisons,
        "placement_control": placement,
        "calibration_sharing": None if sharing is None else {"sentence": sharing[0], "shares": sharing[1]},
        "calibration_merge": None if merge is None else {"sentence": merge[0], "predicted_over_measured": merge[1],
                                                         "after_measurement": merge_after},
    })


def merge_after_sentence(merge: tuple[str, float | None], after: dict) -> tuple[str, float | None]:
    """The calibration's merge sentence (:func:`relayout.render.merge_sentence`) with what merging
    saved again after the measurement (:func:`replay.physical.calibrate.merge_saving`): how far the per-read
    cost a coalescing saving rests on moved while the runs were measured."""
    us = 1e6
    return (merge[0] + f"; after the measurement it saved {after['saving_seconds'] * us:.0f} us "
            f"[{after['saving_low_seconds'] * us:.0f}, {after['saving_high_seconds'] * us:.0f}]"), merge[1]


def judge_record(record: dict) -> dict:
    """A validation record judged (module doc, "The verdict"): the same record with each cell's
    and each saving's family interval (:func:`_over_repetitions`) and agreement
    (:func:`cell_agreement`, :func:`_judge`; a layout's saving against the placement control of
    its RAM budget, :func:`placement_bound`), each saving at equal disk speed, and at equal disk speed
    and compute (:func:`at_harness_compute`), judged the same way,
    and the ``summary`` (:func:`summarize_validation`). A pure function of the measurements and
    predictions the record holds, so a kept record of an earlier version is judged again by the
    present rules; ``version`` becomes :data:`VALIDATION_VERSION`."""
    if record.get("format") != VALIDATION_FORMAT or not isinstance(record.get("version"), int) or \
            record["version"] < OLDEST_JUDGED:
        raise ValueError(f"not a {VALIDATION_FORMAT} record of version {OLDEST_JUDGED} or later: "
                         f"format {record.get('format')!r}, version {record.get('version')!r}")
    v = copy.deepcopy(record)
    k = len(v["cells"]) + len(v["comparisons"]) + len(v["prefetch_comparisons"])   # the judgements the verdict rests on
    control = v["placement_control"]["blocks"]

    def family(m: dict) -> dict:
        return {**m, "family": _over_repetitions(m["repetitions"], k)["family"]}

    for c in v["cells"]:
        m = c["measured_stall_per_token_s"] = family(c["measured_stall_per_token_s"])
        c["agreement"] = cell_agreement(c["predicted_stall_per_token_s"], m["mean"], m["family"]["low_s"],
                                        m["family"]["high_s"])
    for x, tolerance, bound in [
            *((x, None, placement_bound([b for b in control if b["ram_fraction"] == x["ram_fraction"]] or control))
              for x in v["comparisons"]),
            *((x, PREFETCH_TOLERANCE, None) for x in v["prefetch_comparisons"])]:
        predicted = x["predicted_saving"]["estimate_s"]
        x["measured_saving"] = family(x["measured_saving"])
        x.update(_judge(predicted, x["measured_saving"], tolerance, bound))
        for at in DIAGNOSES:                                 # each run under the model's conditions: no placement left
            if x.get(at):
                m = family(x[at]["measured"])
                x[at] = {"measured": m, **_judge(predicted, m, tolerance)}
    sharing = v.get("calibration_sharing")
    if "calibration_sharing" not in v and v["summary"].get("drive_shares_concurrent_reads"):
        sharing = {"sentence": "this drive shares itself among concurrent reads (the record, of an earlier version, kept "
                               "the flag and not the calibration's sentence)", "shares": True}
    merge = v.get("calibration_merge")
    v["version"] = VALIDATION_VERSION
    v["summary"] = summarize_validation(v["cells"], v["comparisons"], None if v["drift"] is None else v["drift"]["change"],
                                        v["prefetch_comparisons"], v["first_read"],
                                        None if sharing is None else (sharing["sentence"], sharing["shares"]), control,
                                        None if merge is None else (merge["sentence"], merge["predicted_over_measured"]))
    return v


def placement_difference(ram_fraction: float, stock_s: list[float], copy_s: list[float]) -> dict:
    """The placement control of one RAM budget: S of stock and of its second copy per repetition
    (s/token, measured in the same lockstep block), and their difference ``stock - copy`` over the
    repetitions with its 95% interval. The two hold the same bytes in the same order, so the
    difference is what where the disk put a file does to S; a layout saving within it is not
    separable from placement."""
    diff = [a - b for a, b in zip(stock_s, copy_s)]
    return {"ram_fraction": ram_fraction, "stock_s": list(stock_s), "copy_s": list(copy_s),
            "difference": {**_over_repetitions(diff), "repetitions": diff}}


def placement_bound(blocks: list[dict]) -> float | None:
    """How far the placement control admits that placement alone moves S (s/token): the largest
    end, in size, of the 95% intervals of its blocks' differences (:func:`placement_difference`);
    None without a block."""
    if not blocks:
        return None
    return max(max(abs(b["difference"]["low_s"]), abs(b["difference"]["high_s"])) for b in blocks)


def _in_band(ratios: list[float]) -> int:
    """How many predicted/measured ratios lie within :data:`CLOSE_BAND` of 1."""
    return sum(abs(r - 1) <= CLOSE_BAND for r in ratios)


def harness_compute(cells: list[dict], comparisons: list[dict]) -> dict | None:
    """How far the measuring harness's compute ran from the model's, and the model with it.

    Per cell, the measured compute per committed token (the time between waits, from the step
    records) against the model's (``predicted_compute_per_token_s``); and the predictions at
    each run's speed with the compute it ran (:func:`at_harness_compute`). Returns ``excess_min``/``excess_max``
    (fractions of the model's compute) and ``excess_min_s``/``excess_max_s`` (s/token),
    ``layout_spread_s`` (the largest difference in excess between layouts measured with the same
    RAM budget and prefetch source, s/token), ``ratio_min``/``ratio_max``/``within``/
    ``cells_within_band`` of predicted/measured S with that compute over ``cells`` cells, and
    over the layout comparisons judged with it (``savings``), how many lie inside their measured
    interval and how many are ruled out. None for a record without compute (version 8 and before).
    """
    rows = [c for c in cells if c.get("measured_compute_per_token_s") and c.get("predicted_compute_per_token_s")]
    if not rows:
        return None
    excess = [c["measured_compute_per_token_s"]["mean"] - c["predicted_compute_per_token_s"] for c in rows]
    frac = [e / c["predicted_compute_per_token_s"] for e, c in zip(excess, rows)]
    groups = {}
    for e, c in zip(excess, rows):
        groups.setdefault((c["ram_fraction"], c["prefetch"]), []).append(e)
    ratios = [c["at_harness_compute"]["ratio"] for c in rows
              if c.get("at_harness_compute") and c["at_harness_compute"]["ratio"] is not None]
    judged = [x["at_harness_compute"] for x in comparisons if x.get("at_harness_compute")]
    return {"excess_min": min(frac), "excess_max": max(frac), "excess_min_s": min(excess), "excess_max_s": max(excess),
            "layout_spread_s": max(max(g) - min(g) for g in groups.values()),
            "cells": len(ratios), "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
            "within": max((abs(r - 1) for r in ratios), default=None), "cells_within_band": _in_band(ratios),
            "savings": len(judged), "savings_inside": sum(x["predicted_inside_measured"] for x in judged),
            "savings_ruled_out": sum(x["agreement"] == "disagrees" for x in judged)}


def drive_reads_check(cells: list[dict]) -> dict | None:
    """Whether the model and the harness agree on which demand reads reach the drive: per cell
    the model's demand preads that do (``predicted_drive_reads_per_token``) over the harness's
    (the records' ``drive_requests``, one per pread; ``measured_drive_reads_per_token``, absent
    where a run could not read weights with O_DIRECT and the page cache may have served them).
    Returns ``ratio_min``/``ratio_max`` over the ``cells`` cells where the harness read from the
    drive, how many are within :data:`READS_AGREE` (``within``), and ``unmeasured``: cells where
    the model read from the drive and the harness did not; None for a record without them
    (version 11 and before)."""
    rows = [c for c in cells if c.get("measured_drive_reads_per_token")]
    ratios = [c["predicted_drive_reads_per_token"] / c["measured_drive_reads_per_token"]["mean"] for c in rows
              if c["measured_drive_reads_per_token"]["mean"] > 0]
    unmeasured = sum(c["measured_drive_reads_per_token"]["mean"] <= 0 < c["predicted_drive_reads_per_token"] for c in rows)
    if not ratios and not unmeasured:
        return None
    return {"cells": len(ratios), "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
            "within": sum(abs(r - 1) <= READS_AGREE for r in ratios), "unmeasured": unmeasured}


def page_cache_waits(cells: list[dict], comparisons: list[dict]) -> dict | None:
    """What the harness's waits for experts whose own reads the page cache served (the cells'
    ``measured_page_cache_wait_per_token_s``, :func:`replay.physical.stalltrace.page_cache_wait`) come to,
    and the layout savings at equal disk speed less them. Returns per layout the smallest and
    largest mean wait over its cells (``by_layout``, s/token), and over the layout comparisons
    judged that way (``savings``) how many lie inside their measured interval and how many are
    ruled out. None for a record without I/O counts (version 10 and before)."""
    rows = [c for c in cells if c.get("measured_page_cache_wait_per_token_s")]
    if not rows:
        return None
    by_layout = {}
    for c in rows:
        by_layout.setdefault(c["layout"], []).append(c["measured_page_cache_wait_per_token_s"]["mean"])
    judged = [x for x in comparisons if x.get("less_page_cache_waits")]
    return {"by_layout": {m: (min(w), max(w)) for m, w in by_layout.items()}, "savings": len(judged),
            "savings_inside": sum(x["less_page_cache_waits"]["predicted_inside_measured"] for x in judged),
            "savings_ruled_out": sum(x["less_page_cache_waits"]["agreement"] == "disagrees" for x in judged)}


def summarize_validation(cells: list[dict], comparisons: list[dict], drift: float | None = None,
                         prefetch_comparisons: list[dict] = (), first_read: dict | None = None,
                         sharing: tuple[str, bool] | None = None, placement: list[dict] | None = None,
                         merge: tuple[str, float | None] | None = None) -> dict:
    """Whether the model holds (see the module doc), with the counts behind it and the text saying so.

    Each cell's and each saving's ``agreement`` (:func:`cell_agreement`, :func:`_judge`, from
    :func:`judge_record`) is ``"agrees"``, ``"unresolved"`` (outside its 95% interval, inside
    its family one), ``"within placement"`` (a layout saving beyond that by no more than the
    placement control's bound) or ``"disagrees"`` (ruled out). ``verdict``: ``"does not hold"``
    when a measurement rules a prediction out (any ``"disagrees"``, or no cell measured any
    stall); else ``"insufficient"`` with fewer than :data:`VERDICT_REPS` repetitions per cell;
    ``"holds"`` when every cell's predicted S is within :data:`TOLERANCE` of the
    measured mean, the savings that miss their 95% interval (unresolved or within placement) are
    no more than chance gives a correct model in 95% of runs (:func:`replay.evaluation.stats.chance_misses`)
    and the gate decides alike wherever the measured saving is not within placement; otherwise
    ``"inconclusive"``. ``text``: the verdict's sentence on its first line, then one line per
    aspect behind it, each under a label (layout savings, prefetch savings, judgements, the
    disk's drift, ...). ``drift``: how far the disk's probed rate moved during the
    run (largest / smallest probe - 1), when probed; the text then adds predicted/measured S
    with each repetition predicted at its probed speed (the cells' ``at_probed_speed``), a
    diagnosis: the verdict stays on the calibrated profile's predictions. So do the cells'
    ``at_run_speed`` predictions (:func:`at_run_speed`: each run predicted at the rate its own
    disk served it) and ``at_neighbour_speed`` ones (at the rate of the runs measured interleaved
    with it, :func:`neighbour_scales`), which the text reports when the records carry I/O
    counts. ``first_read``: each
    layout's read-once rate (:func:`_read_each_once`); one below :data:`FIRST_READ_SLOW` of the
    fastest is named, with what it means for measuring a rewrite on this disk. ``sharing``: how
    the calibration saw concurrent reads complete (:func:`relayout.render.completion_sentence`);
    a drive that shares itself among them is said in words, with whether the profile's does. ``placement``: the
    placement control's blocks (:func:`placement_difference`); the summary names the largest
    difference between the byte-identical copies the measurement admits, and how many measured
    layout savings are no larger. ``merge``: what merging two reads saved in the calibration
    (and again after the runs) against the profile's prediction
    (:func:`relayout.render.merge_sentence`: its sentence and predicted / measured, None when
    nothing was saved), said under "per-read cost": a check of the per-read cost on pairs of
    reads in isolation, not of a layout's saving."""
    ratios = [c["ratio"] for c in cells if c["ratio"] is not None]
    lo, hi = (min(ratios), max(ratios)) if ratios else (None, None)
    within = max(abs(r - 1) for r in ratios) if ratios else None
    states = [c["agreement"] for c in cells]
    cells_out, cells_open = states.count("disagrees"), states.count("unresolved")
    decided = [c for c in comparisons if c["sign_agrees"] is not None]
    sign_wrong = [c for c in decided if not c["sign_agrees"]]
    wrong = [c for c in sign_wrong if c["agreement"] == "disagrees"]
    placed = [c for c in comparisons if c["agreement"] == "within placement"]
    gate_diff = [c for c in comparisons if not c["gate"]["same_decision"] and c["agreement"] != "within placement"]
    gate_placed = [c for c in comparisons if not c["gate"]["same_decision"] and c["agreement"] == "within placement"]
    inside = [c for c in comparisons if c["predicted_inside_measured"]]
    outside = [c for c in comparisons if c["agreement"] == "disagrees" and c["sign_agrees"] is not False]
    contradicted = [c for c in comparisons if c["agreement"] == "disagrees" and "CONTRADICTS" in c["words"]]
    pf_close = [c for c in prefetch_comparisons if c["within_tolerance"]]
    pf_precise = [c for c in prefetch_comparisons if resolves_tolerance(c["measured_saving"], PREFETCH_TOLERANCE)]
    pf_out = [c for c in prefetch_comparisons if c["agreement"] == "disagrees"]
    pf_wrong = [c for c in pf_out if c["sign_agrees"] is False]
    chance = [c for c in [*comparisons, *prefetch_comparisons] if c["agreement"] == "unresolved"]
    missed = len(chance) + len(placed)           # savings outside their 95% interval, not ruled out
    M, P = len(comparisons), len(prefetch_comparisons)
    allowed = chance_misses(M + P) if M + P else 0
    spreads = [(max(c["measured_stall_per_token_s"]["repetitions"]) - min(c["measured_stall_per_token_s"]["repetitions"]))
               / c["measured_stall_per_token_s"]["mean"] for c in cells
               if c.get("measured_stall_per_token_s") and c["measured_stall_per_token_s"]["mean"] > 0]
    spread = max(spreads) if spreads else None
    ratio_ok = within is not None and within <= TOLERANCE
    ruled_out = bool(cells_out or wrong or outside or pf_out or not ratios)
    reps = min((len(c["measured_stall_per_token_s"]["repetitions"]) for c in cells
                if c.get("measured_stall_per_token_s")), default=0)
    few = reps < VERDICT_REPS
    holds = ratio_ok and not cells_open and not ruled_out and not gate_diff and missed <= allowed and not few
    verdict = ("holds" if holds else "does not hold" if ruled_out else "insufficient" if few else "inconclusive")
    span = f"predicted/measured S {lo:.2f}-{hi:.2f} over {len(ratios)} cells" if ratios else "no cell measured any stall"
    open_cells = (f"{cells_open} of {len(cells)} cell(s) are beyond +/-{TOLERANCE:.0%} but inside their measured family "
                  "interval widened by it")
    if verdict == "holds":
        head = f"the model holds on this disk within {math.ceil(round(within * 100, 6))}% ({span})"
    elif verdict == "insufficient":
        reach = (f"over {reps}, a 95% interval reaches {student_t_quantile(0.975, reps):.1f} standard errors either "
                 "side, so an agreement confirms little, and " if reps >= 2 else "")
        head = (f"INSUFFICIENT on this disk: {reps} repetition(s) per cell, where a verdict needs {VERDICT_REPS} "
                f"({reach}no measurement here rules the model out); rerun with --reps {VERDICT_REPS} or a larger "
                f"--minutes ({span})")
    elif verdict == "does not hold":
        why = []
        if not ratios:
            why.append(span)
        if cells_out:
            why.append(f"in {cells_out} of {len(cells)} cell(s) the predicted S lies outside the measured family "
                       f"interval widened by +/-{TOLERANCE:.0%}")
        if wrong:
            why.append(f"the layout saving's sign is wrong beyond the measured family interval and placement in "
                       f"{len(wrong)} of {M} comparison(s)")
        if outside:
            why.append(f"the predicted layout saving lies beyond the measured family interval and placement in "
                       f"{len(outside)} of {M}")
        if pf_wrong:
            why.append(f"the prefetch saving's sign is wrong beyond the measured family interval in {len(pf_wrong)} of {P}")
        if len(pf_out) > len(pf_wrong):
            why.append(f"the predicted prefetch saving lies beyond the measured family interval widened by "
                       f"+/-{PREFETCH_TOLERANCE:.0%} in {len(pf_out) - len(pf_wrong)} of {P}")
        if cells_open:
            why.append(open_cells)
        head = "the model does NOT hold on this disk: " + "; ".join(why) + (f" ({span})" if ratios else "")
    else:
        why = []
        if not ratio_ok and not cells_open:
            why.append(f"predicted/measured S is beyond +/-{TOLERANCE:.0%} in some cell")
        if cells_open:
            why.append(open_cells)
        if gate_diff:
            why.append(f"the gate would decide differently in {len(gate_diff)} of {M}")
        if missed > allowed:
            why.append(f"{missed} of {M + P} saving(s) lie outside their measured 95% interval, more than the {allowed} "
                       "chance gives a correct model in 95% of runs, though none is ruled out"
                       + (f" ({len(placed)} of them beyond their family interval by no more than placement alone does)"
                          if placed else ""))
        advice = []
        if cells_open or gate_diff or len(chance) > allowed:
            advice.append("the measured runs scatter too widely to decide: rerun with more --reps on an idle disk")
        if placed and missed > allowed:
            advice.append("more repetitions do not separate a layout saving from placement: on this disk a layout "
                          "saving smaller than the placement control's difference cannot be measured")
        head = (f"INCONCLUSIVE on this disk: no measurement rules the model out, but it is not confirmed ({span}): "
                + "; ".join(why) + (". " + "; ".join(advice)[0].upper() + "; ".join(advice)[1:] if advice else ""))
    harness = harness_compute(cells, comparisons)
    if (verdict != "holds" and harness and harness["excess_max"] > HARNESS_EXCESS and not pf_out
            and 0 < harness["cells_within_band"] == harness["cells"] and not harness["savings_ruled_out"]):
        head += (f". The measuring harness's own work lengthened its compute by up to {harness['excess_max']:.0%} of the "
                 f"model's, and at each run's speed with the compute it ran every cell's S is within "
                 f"{math.ceil(round(harness['within'] * 100, 6))}% of measurement"
                 + (f" and no layout saving is ruled out (inside the measured interval: {harness['savings_inside']} of "
                    f"{harness['savings']})" if harness["savings"] else "")
                 + ": the gap is the harness's more than the model's")
    probed = [c["at_probed_speed"]["ratio"] for c in cells if c.get("at_probed_speed") and c["at_probed_speed"]["ratio"]]
    probed_within = max(abs(r - 1) for r in probed) if drift is not None and probed else None
    if (verdict != "holds" and (cells_out or cells_open or not ratio_ok) and probed_within is not None
            and _in_band(probed) == len(probed) > _in_band(ratios)):
        head += (f". The disk's own speed moved by {drift:.0%} during the run, and at its probed speed every cell's S is "
                 f"within {math.ceil(round(probed_within * 100, 6))}% of measurement: the gap on the profile is the disk's "
                 "speed more than the model")
    lines = [head]

    def line(label: str, sentence: str) -> None:
        lines.append(f"  {label}: {sentence}")

    if M:
        line("layout savings", f"the predicted saving lies inside the measured 95% interval in {len(inside)} of {M} "
             f"comparison(s)" + (f", beyond its family interval by no more than placement alone does in {len(placed)}"
                                 if placed else "")
             + f"; the sign is wrong in {len(sign_wrong)} of {len(decided)} where the measured 95% interval excludes "
             f"zero ({len(wrong)} of them ruled out); the gate (low end >= {GATE_THRESHOLD:.0%} of TPOT) decides "
             f"differently in {len(gate_diff)} of {M}" + (f" and in {len(gate_placed)} more whose prediction is off by no "
                                                       "more than placement" if gate_placed else ""))
    if P:
        line("prefetch savings", f"the predicted prefetch saving is within +/-{PREFETCH_TOLERANCE:.0%} of the measured "
             f"one in {len(pf_close)} of {P} and ruled out by the measurement in {len(pf_out)} of {P}; the measurement "
             f"itself resolves +/-{PREFETCH_TOLERANCE:.0%} (its 95% interval's half-width within that fraction of the "
             f"measured saving) in {len(pf_precise)} of {P}, and there the prediction is within it in "
             f"{sum(c['within_tolerance'] for c in pf_precise)}")
    family = next((c["measured_stall_per_token_s"]["family"] for c in cells
                   if c.get("measured_stall_per_token_s", {}).get("family")), None)
    if family:
        line("judgements", f"this verdict rests on {family['judgements']} (each cell's S, each layout's and each "
             f"prefetch source's saving); a prediction is ruled out only beyond its {family['level']:.2%} interval, "
             "so that a correct model is ruled out by chance in at most 5% of runs"
             + (f"; over {reps} repetitions that interval is {family_widening(family['level'], reps):.1f} times as wide "
                "as the 95% one" if reps > 1 else ""))
    if missed:
        line("chance", f"{missed} of {M + P} saving(s) lie outside their measured 95% interval without being ruled "
             f"out; up to {allowed} such are what chance gives a correct model in 95% of runs")
    if contradicted:
        line("contradicted", f"measurement CONTRADICTS the prediction in {len(contradicted)} comparison(s): "
             + "; ".join(f"{c['layout']} at RAM {c['ram_fraction']:g}, prefetch {c['prefetch']}" for c in contradicted))
    if spread is not None and spread > TOLERANCE:
        line("repetitions", f"those of one cell differ by up to {spread:.0%} of their mean: the disk was not steady "
             "(other I/O?)" + ("" if verdict == "inconclusive" else
                               ", so rerun on an idle machine or with more --reps before reading the savings"))
    if probed_within is not None:
        line("the disk's drift", f"its probed rate moved by {drift:.0%} during the run; predicting each repetition at "
             f"its probed speed gives predicted/measured S {min(probed):.2f}-{max(probed):.2f} "
             f"({_in_band(probed)} of {len(probed)} cells within +/-{CLOSE_BAND:.0%}, "
             f"against {_in_band(ratios)} of {len(ratios)} on the profile as calibrated)")
    at_run = [c["at_run_speed"]["ratio"] for c in cells if c.get("at_run_speed") and c["at_run_speed"]["ratio"]]
    run_within = max(abs(r - 1) for r in at_run) if at_run else None
    at_near = [c["at_neighbour_speed"]["ratio"] for c in cells
               if c.get("at_neighbour_speed") and c["at_neighbour_speed"]["ratio"]]
    run_savings = [c["at_run_speed"] for c in comparisons if c.get("at_run_speed")]
    run_pf = [c["at_run_speed"] for c in prefetch_comparisons if c.get("at_run_speed")]
    if at_run:
        scales = [f for c in cells if c.get("at_run_speed") for f in c["at_run_speed"]["scales"]]
        sentence = (f"the speed each run's disk served its reads at (the run's drive bytes over the time the drive was "
                    f"busy, {min(scales):.2f}-{max(scales):.2f} times the profile's) gives predicted/measured S "
                    f"{min(at_run):.2f}-{max(at_run):.2f} ({_in_band(at_run)} of {len(at_run)} cells within "
                    f"+/-{CLOSE_BAND:.0%}): this tests the read path, queueing and overlap with compute, not a forecast of "
                    "the disk's speed")
        compute = max((c["predicted_tpot_s"] - c["predicted_stall_per_token_s"]) / c["predicted_stall_per_token_s"]
                      for c in cells if c["predicted_stall_per_token_s"] > 0)
        if compute < TOLERANCE:
            sentence += (f", and with compute at most {compute:.0%} of S here, S is mostly drive time and this check is "
                         "close to an identity: what it shows is that the gap on the profile is the disk's speed")
        line("at each run's speed", sentence)
        if at_near:
            line("at the neighbours' speed", f"the speed of the runs interleaved with each run (read off those runs, "
                 f"not the run itself: a test of the prediction with the disk's drift followed) gives predicted/measured S "
                 f"{min(at_near):.2f}-{max(at_near):.2f} ({_in_band(at_near)} of {len(at_near)} cells within "
                 f"+/-{CLOSE_BAND:.0%})")
        for what, xs in (("layout", run_savings), ("prefetch", run_pf)):
            if xs:
                width = max((x["measured"]["high_s"] - x["measured"]["low_s"]) / 2 for x in xs) * 1e3
                close = (f", within +/-{PREFETCH_TOLERANCE:.0%} of it in {sum(x['within_tolerance'] for x in xs)}"
                         if what == "prefetch" else "")
                line(f"{what} savings at equal disk speed", f"the predicted {what} saving lies inside the measured "
                     f"interval in {sum(x['predicted_inside_measured'] for x in xs)} of {len(xs)} (half-widths up to "
                     f"{width:.2f} ms/token){close}, ruled out in {sum(x['agreement'] == 'disagrees' for x in xs)}")
    if harness:
        line("the harness's compute", f"the measuring harness computed {harness['excess_min']:+.0%} to "
             f"{harness['excess_max']:+.0%} more than the model's compute ({harness['excess_min_s'] * 1e3:+.2f} to "
             f"{harness['excess_max_s'] * 1e3:+.2f} ms/token; in that excess, layouts of one RAM budget and prefetch "
             f"source differ by up to {harness['layout_spread_s'] * 1e3:.2f} ms/token): its own Python work beyond the "
             "emulated compute. Counted as compute between a layer's reads, that work overlaps them and hides stall the "
             "runtime would show, the more so for layouts issuing more reads; relayout's harness times its waits in the "
             "compute model's time, so an excess that is large or differs between layouts marks a record measured before "
             "it did"
             + (f"; at each run's speed with the compute it ran, the model gives predicted/measured S "
                f"{harness['ratio_min']:.2f}-{harness['ratio_max']:.2f} ({harness['cells_within_band']} of "
                f"{harness['cells']} cells within +/-{CLOSE_BAND:.0%})" if harness["cells"] else "")
             + (f", and at equal disk speed and compute the predicted layout saving lies inside the measured interval "
                f"in {harness['savings_inside']} of {harness['savings']}, ruled out in {harness['savings_ruled_out']}"
                if harness["savings"] else ""))
    reads = drive_reads_check(cells)
    if reads:
        sentence = (f"the model's demand preads that reach the drive are {reads['ratio_min']:.2f}-"
                    f"{reads['ratio_max']:.2f} times the harness's per token ({reads['within']} of {reads['cells']} "
                    f"cells within +/-{READS_AGREE:.0%})" if reads["cells"] else "")
        if reads["unmeasured"]:
            sentence += (", and " if sentence else "") + (f"in {reads['unmeasured']} cell(s) the model read from the drive "
                                                          "and the harness did not")
        if reads["within"] < reads["cells"] or reads["unmeasured"]:
            sentence += (": the two read the same preads (one read path) and disagree about which of them reach the drive, "
                         "a difference in what is read, not in the drive's speed")
            if reads["cells"] and reads["ratio_min"] > 1 + READS_AGREE:
                sentence += ("; the model's page cache (Linux's readahead at the profile's read_ahead_bytes, each arm alone) "
                             "held fewer scale pages than the kernel's, which arms reading the same container share, or, "
                             "where the harness tested with RWF_NOWAIT (page_cache_test in its runs' configuration), it took "
                             "a scale read whose own readahead had completed before it looked for a page-cache hit")
            elif reads["cells"] and reads["ratio_max"] < 1 - READS_AGREE:
                sentence += ("; the kernel's page cache held fewer scale pages than the model's: a pread that finds its pages "
                             "still being read by an earlier readahead waits for the drive (the harness counts it as a drive "
                             "read, the model as served from the page cache), or the kernel read less ahead than the "
                             "Linux 6.16-6.19 readahead the model follows")
        line("drive reads", sentence)
    waits = page_cache_waits(cells, comparisons)
    if waits and max(hi for _, hi in waits["by_layout"].values()) > 0:
        line("waits for the page cache", "the harness's compute thread waited "
             + ", ".join(f"{lo * 1e3:.2f}-{hi * 1e3:.2f} ms/token in {m}" for m, (lo, hi) in waits["by_layout"].items())
             + " for experts whose own reads the page cache served (a coalesced run's later experts: their weights come "
             "with the run's first read, their scale reads follow as jobs of their own and find their pages cached): "
             "bytes the runtime, in C, has in microseconds, and the model charges memory time for, where a Python "
             "harness's reader thread takes tens of microseconds a job"
             + (f"; at equal disk speed less these waits, the predicted layout saving lies inside the measured interval "
                f"in {waits['savings_inside']} of {waits['savings']}, ruled out in {waits['savings_ruled_out']}"
                if waits["savings"] else ""))
    slow = []
    if first_read:
        fastest = max(r["rate_Bps"] or 0.0 for r in first_read.values())
        slow = [(m, r["rate_Bps"] / fastest) for m, r in first_read.items() if fastest and r["rate_Bps"] is not None
                and r["rate_Bps"] < FIRST_READ_SLOW * fastest]
    if slow:
        line("first reads", "read once before measuring, " + ", ".join(f"the {m} container ran at {f:.0%}" for m, f in slow)
             + " of the fastest: this disk does not serve every file alike on a first read (a host cache or a lazily "
             "fetched volume below the guest can do this), so every container was read once before any was measured; "
             "runtime measurements of two containers on this disk are comparable only after the same")
    if sharing and sharing[1]:
        line("the drive", "the calibration found that " + sharing[0])
    if merge:
        line("per-read cost", "in the calibration, " + merge[0])
    bound, hidden = None, None
    if placement:
        bound = placement_bound(placement)
        hidden = sum(abs(c["measured_saving"]["estimate_s"]) <= bound for c in comparisons)
        block = max(placement, key=lambda b: placement_bound([b]))
        worst = block["difference"]
        line("placement control", f"two byte-identical copies of stock differed by {worst['estimate_s'] * 1e3:+.2f} "
             f"ms/token [{worst['low_s'] * 1e3:+.2f}, {worst['high_s'] * 1e3:+.2f}] at RAM {block['ram_fraction']:g} "
             f"(the block whose interval reaches farthest): a measured layout saving within {bound * 1e3:.2f} ms/token "
             f"is not separable from where the disk put the files, and {hidden} of {M} are no larger")
    text = "\n".join(lines)
    return {"verdict": verdict, "holds": bool(holds), "drift": drift, "probed_within": probed_within,
            "drive_shares_concurrent_reads": None if sharing is None else sharing[1],
            "merge_saving_predicted_over_measured": None if merge is None else merge[1],
            "placement_bound_s": bound, "savings_no_larger_than_placement": hidden,
            "run_speed_within": run_within,
            "run_speed_cells_within_band": _in_band(at_run) if at_run else None,
            "neighbour_speed_within": max(abs(r - 1) for r in at_near) if at_near else None,
            "neighbour_speed_cells_within_band": _in_band(at_near) if at_near else None,
            "run_speed_savings_inside": sum(x["predicted_inside_measured"] for x in run_savings) if run_savings else None,
            "run_speed_prefetch_inside": sum(x["predicted_inside_measured"] for x in run_pf) if run_pf else None,
            "run_speed_prefetch_within_tolerance": sum(x["within_tolerance"] for x in run_pf) if run_pf else None,
            "first_read_slow": [m for m, _ in slow],
            "harness_compute": harness,
            "page_cache_waits": waits,
            "drive_reads": reads,
            "repetition_spread_max": spread, "ratio_min": lo, "ratio_max": hi, "within": within, "tolerance": TOLERANCE,
            "cells": len(cells), "cells_disagree": cells_out, "cells_unresolved": cells_open,
            "comparisons": M, "inside_measured": len(inside), "outside_measured": len(outside),
            "sign_decided": len(decided), "sign_wrong": len(sign_wrong), "sign_wrong_ruled_out": len(wrong),
            "judged_within_placement": len(placed), "unresolved_savings": len(chance), "chance_allows": allowed,
            "gate_disagreements": len(gate_diff), "gate_disagreements_within_placement": len(gate_placed),
            "contradictions": len(contradicted), "prefetch_comparisons": P, "prefetch_within_tolerance": len(pf_close),
            "prefetch_disagree": len(pf_out), "prefetch_resolved": len(pf_precise),
            "prefetch_resolved_within_tolerance": sum(c["within_tolerance"] for c in pf_precise),
            "prefetch_tolerance": PREFETCH_TOLERANCE, "text": text}


def write_validation_plot(record: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Predicted vs measured S, one point per cell (ms/token; bars span the repetitions), with
    y = x and the verdict's +/-:data:`TOLERANCE` band. PNG written crash-safely; needs the ``plots`` extra."""
    plt = plotting()
    out = make_dirs(out_dir)
    cells = record["cells"]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    markers = {"none": "o", "oracle": "^", "coupled": "s"}
    colors = {"stock": "tab:gray", "louvain": "tab:blue", "random": "tab:orange"}
    seen = set()
    top = 0.0
    for c in cells:
        x = c["measured_stall_per_token_s"]["mean"] * 1e3
        reps = [v * 1e3 for v in c["measured_stall_per_token_s"]["repetitions"]]
        y = c["predicted_stall_per_token_s"] * 1e3
        top = max(top, x, y, *reps)
        label = f"{c['layout']}, prefetch {c['prefetch']}"
        ax.errorbar([x], [y], xerr=[[x - min(reps)], [max(reps) - x]], fmt=markers.get(c["prefetch"], "o"),
                    color=colors.get(c["layout"], "black"), label=None if label in seen else label, capsize=3)
        seen.add(label)
    top = top * 1.1 or 1.0
    line = np.array([0.0, top])
    ax.plot(line, line, color="black", linewidth=1, label="predicted = measured")
    ax.fill_between(line, line * (1 - TOLERANCE), line * (1 + TOLERANCE), color="tab:green", alpha=0.15,
                    label=f"+/-{TOLERANCE:.0%} (the model holds inside)")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured S (ms per committed token)")
    ax.set_ylabel("predicted S (ms per committed token)")
    ax.set_title(f"Replay model vs measurement on {record['device']['name']}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    path = out / "validation_predicted_vs_measured.png"
    try:
        with atomic_output(path) as fh:
            fig.savefig(fh, dpi=110, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return [path]


__all__ = ["GATE_THRESHOLD", "LAYOUTS", "PREFETCH_TOLERANCE", "TOLERANCE", "VALIDATION_FORMAT", "VALIDATION_VERSION", "ValidateOptions",
           "cell_agreement", "check_options", "parse_list", "summarize_validation", "validate", "write_validation_plot"]
