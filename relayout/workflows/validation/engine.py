"""``relayout validate --engine``: the replay model against the real colibrì engine, cell by cell.

In the validation's directory PATH (its marker :data:`MARKER` records what it made there):

1. **Training routing.** The engine runs every training prompt once on the stock container with
   ``ROUTE_TRACE`` (``train/``); the recorded sessions train the plans (``plan-<layout>.json``),
   which are rewritten into containers (``layout-<layout>/``, a plan's container kept while its
   plan is unchanged), with one more rewrite of the stock plan, the placement control
   (``layout-stock-copy/``: stock's tensors in stock's order in fresh files, each expert aligned to
   4 KiB as every rewrite aligns it). The measured prompts
   are others: every measured session is held out.
2. **Measurement.** Per cell (a read path of ``--read-paths`` x an LRU cap of ``--caps``, with
   ``CAP_RAISE=0 AUTOPIN=0`` and ``--engine-env``), every layout runs every measured prompt
   ``--reps`` times, cold, layouts interleaved (:func:`relayout.workflows.engine_runs.measure_engine`;
   ``cells/<cell>/<layout>/pPP-rRR``). A run directory under its final name is complete, and a
   second invocation on the same inputs keeps it: the validation resumes.
3. **Prediction.** Each run's own routing (its ``route-trace.txt``) is replayed through the model
   with the configuration the run printed (``[PROF] config``, the OpenMP team, the matmul rate,
   the memory the run found; :func:`relayout.planning.replay_setup.runtime_config`) on the layout
   of the container it ran and the device profile (``--device``, else the disk calibrated on the
   stock container's largest file), and its stall over the decode forwards is the predicted wait.
4. **Judging** (:mod:`.engine_record`): predicted against measured S per layout and cell, the
   predicted saving against the measured one, the gate's rule on both, a verdict in words.

Around each cell's runs the disk is probed (:func:`probe_cell`: O_DIRECT reads of one expert's
size from the stock container's largest file, one at a time, before and after, kept in
``cells/<cell>/disk-probe.json``) and set against the rate the device profile gives the same
reads: a cell whose disk ran far from the profile's speed is named in the verdict.

Seconds and bytes in the record; prompts are text, one per line.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from containers.atomic import make_dirs, write_json_atomic
from containers.errors import InputError

from replay.colibri.engine_output import RUN_FILE

from ..engine_runs import EngineArm, measure_engine, read_prompts
from ..workdir import WorkDir
from .engine_record import (ENGINE_VALIDATION_FORMAT, ENGINE_VALIDATION_VERSION, PLACEMENT_COPY, CellResult,
                            EngineValidationRecord, RunResult, arm_result, placement_bound, saving_result, summarize)
from .rules import TOLERANCE

DEFAULT_READ_PATHS = ("PIPE=0", "PIPE=1", "URING=1")
"""colibrì's read paths measured by default: its Linux default, the loader pool, io_uring (all buffered)."""
DEFAULT_CAPS = (4, 12)
"""Experts per layer the engine's LRU holds in the two default cells (``CAP``)."""
CELL_VARIABLES = "CAP_RAISE=0 AUTOPIN=0"
"""Held in every cell: the cap as given (not raised to the RAM), no automatic pins."""
MARKER = ".relayout-validate-engine"
SETUP_NAME = "setup.json"
RECORD_NAME = "validation-engine.json"
DEVICE_NAME = "device.json"
LAYOUTS = ("stock", "louvain", "random", "frequency", "heat")


@dataclass(frozen=True, kw_only=True)
class EngineValidateOptions:
    """What ``validate --engine`` was asked. Paths as given; ``ngen`` tokens per run."""

    path: Path
    engine: Path
    container: Path
    prompts: Path
    train_prompts: Path
    layouts: tuple[str, ...] = ("stock", "louvain", "random")
    read_paths: tuple[str, ...] = DEFAULT_READ_PATHS
    caps: tuple[int, ...] = DEFAULT_CAPS
    reps: int = 3
    ngen: int = 24
    engine_env: str = ""
    device: str | None = None
    output: Path | None = None
    seed: int = 0
    timeout_s: float | None = None


def cell_env(read_path: str, cap: int, engine_env: str = "") -> str:
    """The engine variables of one cell: the read path, ``CAP``, :data:`CELL_VARIABLES` and the extra ones."""
    return " ".join(w for w in (read_path, f"CAP={cap}", CELL_VARIABLES, engine_env) if w)


def cell_name(read_path: str, cap: int) -> str:
    """A cell's directory name: ``PIPE=1 DIRECT=1`` at cap 4 is ``pipe-1_direct-1-cap4``; a file a
    variable names is named by its file name (``COUPLE=/a/t.coli_pairs``: ``couple-t.coli_pairs``)."""
    words = []
    for w in read_path.split():
        name, _, value = w.partition("=")
        words.append(f"{name}-{Path(value).name}".lower())
    return "_".join(words) + f"-cap{cap}"


def check_options(o: EngineValidateOptions) -> tuple[list[str], list[str]]:
    """Everything checkable before the engine runs; returns the measured and the training prompts.

    Raises
    ------
    InputError
        An engine that is not an executable file, a container directory without safetensors files,
        unreadable or overlapping prompt files, a layout not known or stock not first, a read path
        the model does not run, a cap below 1, fewer than 2 repetitions.
    """
    from replay.colibri.engine_config import env_words, model_config, not_modelled, parse_runtime_env
    from replay.model.config import RuntimeConfig

    from ..engine_runs import container_files

    if not (o.engine.is_file() and os.access(o.engine, os.X_OK)):
        raise InputError(o.engine, "not an executable file (the colibrì engine binary)")
    if not o.container.is_dir():
        raise InputError(o.container, "not a directory (a colibrì container)")
    container_files(o.container)
    bad = [m for m in o.layouts if m not in LAYOUTS]
    if bad or not o.layouts or o.layouts[0] != "stock" or len(set(o.layouts)) != len(o.layouts) or len(o.layouts) < 2:
        raise InputError(None, f"--layouts must start with stock, the baseline, and name another of {', '.join(LAYOUTS)} "
                               f"once each (got {','.join(o.layouts)})")
    if o.reps < 2:
        raise InputError(None, f"--reps must be at least 2 (an interval over runs), got {o.reps}")
    if not o.caps or any(c < 1 for c in o.caps):
        raise InputError(None, "--caps must be experts per layer, each at least 1")
    env_words(o.engine_env, "--engine-env", strict=False)       # passed to the engine as given (OMP_WAIT_POLICY, ...)
    for rp in o.read_paths:
        cfg = parse_runtime_env(cell_env(rp, o.caps[0]), "--read-paths")
        missing = not_modelled(cfg)                            # refuses what the model does not run, naming it
        if missing:
            raise InputError("--read-paths", "; ".join(missing))
        model_config(cfg, RuntimeConfig(), o.caps[0], pilot_precision=1.0 if cfg.PILOT or cfg.PILOT_REAL else None)
    prompts, train = read_prompts(o.prompts), read_prompts(o.train_prompts)
    shared = set(prompts) & set(train)
    if shared:
        raise InputError(o.prompts, f"{len(shared)} prompt(s) are also training prompts ({o.train_prompts}); the measured "
                                    "prompts must be held out")
    return prompts, train


def _digest(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


def _check_setup(work: WorkDir, o: EngineValidateOptions) -> None:
    """Record the inputs the runs in PATH rest on; refuse a PATH holding runs of other inputs."""
    setup = {"engine": str(o.engine.resolve()), "container": str(o.container.resolve()), "ngen": o.ngen,
             "prompts": _digest(o.prompts), "train_prompts": _digest(o.train_prompts), "seed": o.seed}
    path = work.path / SETUP_NAME
    if path.is_file() and work.paths.get(SETUP_NAME):
        from containers.jsonfile import parse_json

        old = parse_json(path.read_bytes())
        if old != setup:
            changed = ", ".join(k for k in setup if not isinstance(old, dict) or old.get(k) != setup[k])
            raise InputError(work.path, f"holds a validation of other inputs ({changed} differ); give a new directory")
        return
    write_json_atomic(work.claim(SETUP_NAME), setup)


def _reused(work: WorkDir, name: str) -> Path:
    """``name`` in the work directory: kept when a previous run made it (its complete runs are reused), else claimed."""
    if os.path.lexists(work.path / name) and name in work.paths:
        return work.path / name
    return work.claim(name)


def _source_manifest(work: WorkDir, src: Path, notify) -> Path:
    from containers.container import MANIFEST_NAME, Container
    from containers.manifest import build_manifest, write_manifest

    if (src / MANIFEST_NAME).is_file():
        return src / MANIFEST_NAME
    path = work.path / "source-manifest.json"
    if path.is_file() and "source-manifest.json" in work.paths:
        return path
    notify(f"{src} has no {MANIFEST_NAME}: hashing it once (kept in {work.path}; the source is not modified)")
    write_manifest(build_manifest(Container.open(src)), work.claim("source-manifest.json"))
    return path


def uses_pilot(o: EngineValidateOptions) -> bool:
    """Whether a cell runs colibrì's router pilot (PILOT, PILOT_REAL or PILOT_TWO set to 1)."""
    return any(_pilot_variables(cell_env(rp, 1, o.engine_env)) for rp in o.read_paths)


def _pilot_variables(env: str) -> set[str]:
    """The router pilot's variables set to 1 among a cell's engine words (``--engine-env``'s too)."""
    from replay.colibri.engine_config import env_words

    words = env_words(env, "--read-paths", strict=False)
    return {name for name in ("PILOT", "PILOT_REAL", "PILOT_TWO") if words.get(name) == "1"}


def _cell_precision(env: str, precisions: dict) -> float | None:
    """The router pilot's precision for a cell of variables ``env`` (None: no pilot): the training
    runs' two-step one under PILOT_TWO, else their stale one (``precisions`` by ``two_step``)."""
    on = _pilot_variables(env)
    return precisions["PILOT_TWO" in on] if on else None


def training_pilot_precision(train_dir: Path, two_step: bool = False) -> float:
    """The share of the router pilot's predictions the next layer routed over the training runs
    (their ``LOOKA=1`` lines pooled: hits over the next layers' routed experts; ``two_step``: of its
    two-step prediction, PILOT_TWO's). Raises :class:`InputError` when no training run printed one
    (runs recorded without LOOKA=1)."""
    from replay.colibri.engine_output import read_runs

    looks = [look for r in read_runs(train_dir)
             if (look := r.output.pilot_two_lookahead if two_step else r.output.pilot_lookahead)]
    total = sum(t for _, t in looks)
    if not total:
        raise InputError(train_dir, "no training run printed the router pilot's precision (LOOKA=1): record the "
                                    "training routing again in a new directory")
    return sum(h for h, _ in looks) / total


def prepare_layouts(o: EngineValidateOptions, work: WorkDir, train_prompts: list[str], notify) -> tuple[dict, list[str]]:
    """Record the training routing, plan every layout from it and rewrite the plans.

    Returns
    -------
    ``({layout: container directory}, training session names)``.
    """
    from containers.jsonfile import read_bytes
    from relayout.planning.plan import make_plan, source_from_container
    from relayout.traces.importer import import_traces
    from replay.colibri.engine_config import env_words
    from replay.colibri.engine_output import ROUTE_FILE
    from replay.formats.planfile import load_plan, save_plan

    from ..apply import apply_plan

    train_dir = _reused(work, "train")
    notify(f"recording the routing of {len(train_prompts)} training prompt(s) on {o.container} ({train_dir})")
    env = env_words(cell_env(o.read_paths[0], o.caps[0], o.engine_env), strict=False)
    if uses_pilot(o):
        env["LOOKA"] = "1"                    # the router pilot's precision, for the cells that run it
    runs = measure_engine(o.engine, [EngineArm("train", o.container)], train_prompts, 1, env, o.ngen, train_dir,
                          timeout_s=o.timeout_s, progress=notify)
    traces = [r / ROUTE_FILE for r in runs if (r / ROUTE_FILE).is_file() and (r / ROUTE_FILE).stat().st_size]
    if len(traces) < 2:
        raise InputError(train_dir, "fewer than 2 training runs recorded their routing (ROUTE_TRACE): nothing to plan from")
    trace, _ = import_traces(traces)
    manifest = _source_manifest(work, o.container, notify)
    source = source_from_container(o.container, manifest)
    dirs = {"stock": o.container}
    for arm in [PLACEMENT_COPY] + list(o.layouts[1:]):
        method = "stock" if arm == PLACEMENT_COPY else arm
        plan_dict = make_plan(trace, source, method, train_fraction=1.0, seed=o.seed, progress=False)
        plan_name, layout_name = f"plan-{arm}.json", f"layout-{arm}"
        plan_path, layout_dir = work.path / plan_name, work.path / layout_name
        tmp = work.path / f".{plan_name}.new"
        save_plan(plan_dict, tmp)
        same = (plan_path.is_file() and plan_name in work.paths and layout_name in work.paths and layout_dir.is_dir()
                and read_bytes(plan_path) == read_bytes(tmp))
        if same:
            os.unlink(tmp)
        else:
            os.replace(tmp, work.claim(plan_name))
            notify(f"rewriting {o.container} by the {method} plan into {layout_dir}"
                   + (" (the placement control)" if arm == PLACEMENT_COPY else ""))
            apply_plan(o.container, load_plan(plan_path), work.claim(layout_name, layout_name + ".partial"), None, force=True,
                       manifest_path=manifest, progress=False)
        dirs[arm] = layout_dir
    return dirs, list(load_plan(work.path / f"plan-{PLACEMENT_COPY}.json").training.sessions)


def predict_run(run_dir: Path, layout, device, pilot_precision: float | None = None,
                page_cache_gb: float | None = None) -> tuple[float, int, int, int, int]:
    """The model's wait over a colibrì run's decode forwards (every forward but the first, the
    prefill), replaying the run's own routing with the configuration it printed (under
    PILOT=1 or PILOT_REAL=1, the router pilot at ``pilot_precision``; with ``page_cache_gb``, that
    page cache for experts instead of what the run left of its memory).

    Returns
    -------
    ``(predicted wait in seconds, expert loads over the decode forwards, decode forwards, the
    prefetch loads over them, -1 when no prefetcher runs, the bytes read from the drives over the
    whole run, prefill included)``.
    """
    from relayout.planning.replay_setup import RuntimeRequest, runtime_config
    from relayout.traces.importer import import_traces
    from replay.colibri.engine_output import ROUTE_FILE
    from replay.formats.colipairs import configured_pair_table
    from replay.model.engine import simulate

    trace, _ = import_traces([run_dir / ROUTE_FILE])
    from replay.model.config import RuntimeConfig

    # no coalescing under an engine configuration; the dense work precedes routing, so it never
    # overlaps the layer's loads: it does not change the wait
    config = runtime_config(RuntimeRequest(coalesce_max_mb=RuntimeConfig().coalesce_max_bytes / 1e6, dense_ms=0.0,
                                           colibri_run=True, runtime_env_from=str(run_dir),
                                           pilot_precision=pilot_precision, page_cache_gb=page_cache_gb), layout)
    inst, usage = simulate(trace, np.ones(trace.n_forwards, bool), layout, device, config,
                           coupling=configured_pair_table(config, layout))
    drive = int(round(float(np.dot(usage.transfer_seconds, _member_bandwidths(device, layout)))))
    decode = inst.forward != inst.forward.min()
    pilot = int(inst.prefetch.loads[decode].sum()) if inst.prefetch is not None else -1
    return (float(inst.stall[decode].sum()), int(inst.misses[decode].sum()), int(len(np.unique(inst.forward[decode]))),
            pilot, drive)


def _member_bandwidths(device, layout) -> np.ndarray:
    """Each member's transfer rate (bytes/s), as the replay's ``transfer_seconds`` divide by it."""
    from replay.model.engine import device_numbers

    return np.asarray(device_numbers(device, layout).m_bandwidth, dtype=np.float64)


def _device(o: EngineValidateOptions, work: WorkDir, notify):
    from replay.model.device import load_device

    if o.device:
        return load_device(o.device), f"given: {o.device}"
    from replay.physical.calibrate import calibrate

    from .prepare import calibration_target

    target = calibration_target(o.container, o.path)
    notify(f"calibrating the disk on {target} into read buffers as colibrì's (read only when it is the container's file)")
    path = work.claim(DEVICE_NAME)
    write_json_atomic(path, calibrate(target, name=f"calibrated-{o.path.resolve().name or 'disk'}", buffers="engine"))
    return load_device(str(path)), f"calibrated on {target}, saved as {path}"


DISK_PROBE_NAME = "disk-probe.json"
PROBE_DEPTH = 1
"""Reads the disk probe keeps in flight: one, so the probe follows the disk, not a read path."""


def probe_cell(cell_dir: Path, probe: tuple, measure) -> list[float]:
    """The disk's rate before and after a cell's runs (bytes/s; :func:`replay.physical.calibrate.probe_rate`
    on ``probe`` = (file, read bytes)), ``measure()`` running the cell in between, kept in the
    cell's ``disk-probe.json``. A cell probed before keeps its probes; one whose runs were all
    made before, unprobed, gets none (``[]``: a probe now says nothing of the disk then), as
    does a cell with no probe file."""
    from containers.jsonfile import parse_json
    from replay.physical.calibrate import probe_rate

    kept = cell_dir / DISK_PROBE_NAME
    rates = parse_json(kept.read_bytes()).get("rates_Bps") if kept.is_file() else None
    if isinstance(rates, list) and len(rates) == 2 and all(isinstance(r, (int, float)) and r > 0 for r in rates):
        measure()
        return [float(r) for r in rates]
    probe_file, size = probe
    if probe_file is None:
        measure()
        return []
    made_before = set(cell_dir.glob(f"*/*/{RUN_FILE}"))
    before = probe_rate(probe_file, size, PROBE_DEPTH, huge_pages=False)
    measure()
    if set(cell_dir.glob(f"*/*/{RUN_FILE}")) == made_before:
        return []
    rates = [before, probe_rate(probe_file, size, PROBE_DEPTH, seed=1, huge_pages=False)]
    write_json_atomic(kept, {"file": str(probe_file), "read_bytes": size, "depth": PROBE_DEPTH, "rates_Bps": rates})
    return rates


def cell_copy_rate(stock_dir: Path, layout) -> float:
    """The median over a cell's stock runs (on ``layout``, the stock container) of the rate the
    engine's threads copied page-cache hits at (bytes/s per thread,
    :func:`replay.colibri.engine_config.engine_copy_rate`: a decode load's bytes over its thread
    time, else the warm reads' rate); 0.0 when no run said (DIRECT=1, URING=1, no ``PROF=1``)."""
    from replay.colibri.engine_config import config_from_run, engine_copy_rate
    from replay.colibri.engine_output import read_runs

    rates = []
    for run in read_runs(stock_dir):
        if run.identity is None or run.identity.returncode != 0:
            continue
        rate = engine_copy_rate(*config_from_run(Path(run.source)), layout)
        if rate:
            rates.append(rate)
    return float(np.median(rates)) if rates else 0.0


def cell_copy_kind(stock_dir: Path, layout, pilot_precision: float | None = None) -> tuple[int, bool]:
    """How many page-cache copies the model runs at once in a cell (its first complete stock run's
    configuration, on ``layout``; ``pilot_precision`` for a run of the router pilot): the copy
    slots (:attr:`replay.model.config.RuntimeConfig.copy_slots`), at most the loads in flight, and
    whether they are re-touches of mapped pages (COLI_MMAP=1); ``(0, False)`` when no run completed."""
    from relayout.planning.replay_setup import RuntimeRequest, runtime_config
    from replay.colibri.engine_output import read_runs
    from replay.model.config import RuntimeConfig

    for run in read_runs(stock_dir):
        if run.identity is not None and run.identity.returncode == 0:
            config = runtime_config(RuntimeRequest(coalesce_max_mb=RuntimeConfig().coalesce_max_bytes / 1e6, dense_ms=0.0,
                                                   colibri_run=True, runtime_env_from=run.source,
                                                   pilot_precision=pilot_precision), layout)
            return min(config.copy_slots, config.in_flight), config.mapped_views
    return 0, False


def cell_copy_rates(own: dict[str, tuple[float, tuple]]) -> dict[str, tuple[float, str]]:
    """Each cell's page-cache copy rate (bytes/s per thread) and where it comes from, given the
    rate each cell's own stock runs measured and how it copies (``own``, by cell name: a rate of
    0.0 where they measured none, or one no faster than the drives; how many at once and whether
    they are re-touches of mapped pages, :func:`cell_copy_kind`).

    A cell with its own rate takes it (``"its stock runs"``). A cell without one (URING=1 does not
    time its loads; DIRECT=1 reads weights from the drives; several router-pilot threads time
    their waits for each other, :func:`replay.colibri.engine_config.engine_copy_rate`) takes the median of the cells that
    measured one copying alike (``"the median of cells ..."``): the same kernel
    copies page-cache pages into the engine's buffers in every read path, and a thread copies as
    fast as the copies beside it let it. With no such cell, 0.0 and ``""`` (the device profile's
    rates, one thread copying alone).
    """
    out = {}
    for name, (rate, kind) in own.items():
        if rate > 0:
            out[name] = (rate, "its stock runs")
            continue
        like = {n: r for n, (r, k) in own.items() if r > 0 and k == kind}
        out[name] = ((float(np.median(list(like.values()))), f"the median of cells {', '.join(like)}") if like
                     else (0.0, ""))
    return out


def _run_results(arm: str, arm_dir: Path, layout, device, probed, notify, pilot_precision: float | None) -> list[RunResult]:
    """The runs of ``arm`` in ``arm_dir`` (left out: those the engine did not complete), each with the
    model's prediction on ``device`` and on ``probed`` (the same with its drives at the speed the
    disk probed around the cell; ``device`` itself where not probed)."""
    from replay.colibri.engine_metrics import run_metrics
    from replay.colibri.engine_output import read_runs

    out = []
    for run in read_runs(arm_dir):
        ident = run.identity
        if ident is None or ident.returncode != 0:
            notify(f"{run.source}: engine exit status {ident.returncode if ident else '?'}: left out")
            continue
        m = run_metrics(run, arm, "")
        wait, loads, _, pilot, drive = predict_run(Path(run.source), layout, device, pilot_precision)
        at_probe = wait if probed is device else predict_run(Path(run.source), layout, probed, pilot_precision)[0]
        io = run.output.expert_io
        engine_pilot = run.output.pilot_loads
        out.append(RunResult(run.source, arm, ident.prompt, ident.repetition, m.committed_tokens, m.wait_s, wait,
                             (m.tpot_ms or 0.0) / 1e3, io.loads if io is not None else -1, loads, ident.returncode,
                             engine_pilot if engine_pilot is not None else -1, pilot,
                             ident.drive_read_bytes if ident.drive_read_bytes is not None else -1, drive, at_probe))
    if len(out) < 2:
        raise InputError(arm_dir, f"only {len(out)} complete run(s) of {arm}: an interval needs at least 2")
    return out


def _pilot_loads(runs: list[RunResult]) -> list[int]:
    """The router pilot's loads over ``runs``: the engine's (runs that printed them; -1 when none
    did: hints are not counted) and the model's."""
    printed = [r.measured_pilot_loads for r in runs if r.measured_pilot_loads >= 0]
    return [sum(printed) if printed else -1, sum(r.predicted_pilot_loads for r in runs if r.predicted_pilot_loads >= 0)]


def _drive_bytes(runs: list[RunResult]) -> list[float]:
    """Bytes read from storage per run: the engine's and the model's over the runs that counted
    them (the engine's -1 and the model's over all ``runs`` when none did)."""
    counted = [r for r in runs if r.measured_drive_bytes >= 0]
    if not counted:
        return [-1.0, float(np.mean([r.predicted_drive_bytes for r in runs]))]
    return [float(np.mean([r.measured_drive_bytes for r in counted])),
            float(np.mean([r.predicted_drive_bytes for r in counted]))]


def validate_engine(o: EngineValidateOptions, notify=print) -> EngineValidationRecord:
    """Run the module's four steps and write the record (``o.output``, else PATH/:data:`RECORD_NAME`)."""
    from containers.container import Container
    from containers.layout import layout_from_container
    from replay.colibri.engine_config import at_engine_copy_rate, env_words, parse_runtime_env
    from replay.colibri.openmp_team import HANDOFF_NOTE, loaders_on_compute_core

    from .prepare import probe_target

    prompts, train = check_options(o)
    work = WorkDir.open(o.path, MARKER, "validate --engine")
    try:
        _check_setup(work, o)
        dirs, sessions = prepare_layouts(o, work, train, notify)
        precisions = ({two: training_pilot_precision(work.path / "train" / "train", two) for two in (False, True)}
                      if uses_pilot(o) else {})
        device, device_source = _device(o, work, notify)
        if device.loader_handoff is None and any(loaders_on_compute_core(parse_runtime_env(cell_env(rp, o.caps[0])))
                                                 for rp in o.read_paths):
            notify(f"the device profile {device.name} {HANDOFF_NOTE}")
        layouts = {m: layout_from_container(Container.open(d)) for m, d in dirs.items()}
        probe = probe_target(o.container, layouts["stock"])
        profile_rate = device.steady_rate(probe[1], PROBE_DEPTH) if probe[0] is not None else 0.0
        cells_dir = _reused(work, "cells")
        arms = ["stock", PLACEMENT_COPY] + list(o.layouts[1:])
        measured = []
        for rp in o.read_paths:
            for cap in o.caps:
                name, env = cell_name(rp, cap), cell_env(rp, cap, o.engine_env)
                notify(f"cell {name}: {env}")
                make_dirs(cells_dir / name)
                probes = probe_cell(cells_dir / name, probe, lambda: measure_engine(
                    o.engine, [EngineArm(m, Path(dirs[m])) for m in arms], prompts, o.reps, env_words(env, strict=False),
                    o.ngen, cells_dir / name, timeout_s=o.timeout_s, progress=notify))
                own = cell_copy_rate(cells_dir / name / "stock", layouts["stock"])
                own = own if at_engine_copy_rate(device, own, layouts["stock"]) is not device else 0.0
                measured.append((name, env, probes, (own, cell_copy_kind(cells_dir / name / "stock", layouts["stock"],
                                                                                 _cell_precision(env, precisions)))))
        copy_rates = cell_copy_rates({name: own for name, _, _, own in measured})
        cells, all_runs = [], []
        for name, env, probes, _ in measured:
            copy_rate, copy_source = copy_rates[name]
            cell_device = at_engine_copy_rate(device, copy_rate, layouts["stock"]) if copy_rate else device
            pilot = _cell_precision(env, precisions)
            scale = float(np.mean(probes)) / profile_rate if probes else 0.0
            probed = cell_device.scaled(scale) if scale else cell_device
            runs = {m: _run_results(m, cells_dir / name / m, layouts[m], cell_device, probed, notify, pilot) for m in arms}
            all_runs += [r for m in arms for r in runs[m]]
            control = saving_result(PLACEMENT_COPY, runs["stock"], runs[PLACEMENT_COPY])
            bound = placement_bound(control)
            cells.append(CellResult(name, env, [arm_result(m, runs[m]) for m in arms], control.measured,
                                    control.predicted.estimate, bound,
                                    [saving_result(m, runs["stock"], runs[m], placement_s=bound)
                                     for m in o.layouts[1:]], copy_rate, copy_source, probes, scale, pilot or 0.0,
                                    _pilot_loads([r for m in arms for r in runs[m]]) if pilot else [],
                                    _drive_bytes([r for m in arms for r in runs[m]])))
        agree, disagree, unresolved, decided, decisions, verdict, summary = summarize(cells)
        record = EngineValidationRecord(
            format=ENGINE_VALIDATION_FORMAT, version=ENGINE_VALIDATION_VERSION, engine=str(o.engine),
            container=str(o.container), device=device.name, device_source=device_source,
            layouts={m: str(d) for m, d in dirs.items()}, training_sessions=sessions, prompts=len(prompts), reps=o.reps,
            ngen=o.ngen, tolerance=TOLERANCE, cells=cells, runs=all_runs, cells_agree=agree, cells_disagree=disagree,
            cells_unresolved=unresolved, decisions_agree=decided, decisions=decisions, verdict=verdict, summary=summary)
        out = o.output or work.claim(RECORD_NAME)
        write_json_atomic(out, record.to_json())
        return record
    finally:
        work.seal()
