"""The command line's shared pieces: its help formatter, how a command is declared, the option
groups several commands take (geometry scaling, scheduler, the runtime's read path, rewrite) and
how those options are read back (a scaled geometry; a :class:`replay.model.config.RuntimeConfig`
through :mod:`relayout.planning.replay_setup`). Options are in the units the user types: GB, MB, ms, GB/s.
"""

from __future__ import annotations

import argparse
import sys

from containers.container import MANIFEST_NAME
from containers.geometry import load_geometry
from replay.model.config import PREFETCH_SOURCES

from . import options as opt


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help line shows its default, when it has one (not for flags or absent values)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def command(sub, name: str, help: str, func=None) -> argparse.ArgumentParser:
    """Declare command ``name`` under the subparsers ``sub``: ``help`` is its line in the list and,
    capitalised with a full stop, its description; ``func(args)`` runs it."""
    c = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", formatter_class=HelpWithDefaults)
    if func is not None:
        c.set_defaults(func=func)
    return c


def geometry_options(c: argparse.ArgumentParser, full: bool = True) -> None:
    """Pick a geometry and scale it down (the absolute numbering of layers is kept)."""
    g = c.add_argument_group("geometry (scaled-down models keep the real numbering of layers)")
    g.add_argument("--moe-layers", type=opt.integer(1, 4096), help="number of MoE layers (default: the geometry's)")
    g.add_argument("--experts", type=opt.integer(1, 32767), help="routed experts per layer (default: the geometry's)")
    if full:
        g.add_argument("--hidden", type=opt.integer(1, 1 << 20), help="hidden size (default: the geometry's)")
        g.add_argument("--ffn", type=opt.integer(1, 1 << 20), help="expert FFN (moe_intermediate) size (default: the geometry's)")
        g.add_argument("--vocab", type=opt.integer(1, 1 << 24), help="vocabulary size, embedding and lm_head rows (default: the geometry's)")


def scaled_geometry(args, shard_attr: str = "shard_mb"):
    """The geometry ``--geometry`` names, scaled by :func:`geometry_options` and the shard size
    option ``shard_attr`` (MB)."""
    shard_mb = getattr(args, shard_attr, None)
    return load_geometry(args.geometry).scaled(
        moe_layers=args.moe_layers,
        experts=args.experts,
        hidden=getattr(args, "hidden", None),
        ffn=getattr(args, "ffn", None),
        shard_bytes=None if shard_mb is None else int(shard_mb * 1_000_000),
        vocab=getattr(args, "vocab", None),
    )


def scheduler_option(c, what: str) -> None:
    """``--scheduler``: where ``what`` runs."""
    c.add_argument("--scheduler", default="local", metavar="ADDRESS",
                   help=f"where {what} runs: 'local' (a Dask cluster of one worker process per core of this machine; "
                        "serial when dask is not installed), 'none' (serial, in this process) or the address of a "
                        "running Dask scheduler (tcp://host:8786); results are the same on each")


def _prefetch_setting(text: str) -> str:
    """``--prefetch`` of the replay model: one source, or several joined by '+'."""
    from replay.model.config import prefetch_sources

    prefetch_sources(text)
    return text


def runtime_options(c: argparse.ArgumentParser, modelled: bool, ram: bool = True) -> None:
    """The runtime knobs ``replay`` models and ``measure`` performs (``modelled``: replay's extras;
    ``ram``: the LRU's budget, which a command sweeping budgets takes its own way)."""
    r = c.add_argument_group("runtime (colibrì's read path)")
    if ram:
        r.add_argument("--ram-gb", type=opt.gigabytes, default=0.0, help="RAM for the per-layer expert LRU, GB (0 = no cache)"
                       + ("; the gate sizes it by CAP and RAM_GB when a colibrì configuration gives them" if modelled else ""))
    if modelled:
        _colibri_run_options(r)
    r.add_argument("--workers", type=opt.integer(1, 1024), help="relayout's read path: reader workers, 1-16 (default 8)")
    r.add_argument("--batched", action="store_true", help="relayout's read path: a batched queue (io_uring-style, 64 loads in flight)")
    r.add_argument("--coalesce", action="store_true", help="one read for experts contiguous in one file: NEEDS A RUNTIME "
                                                           "CHANGE (colibrì pull request 1398, not merged)")
    r.add_argument("--coalesce-max-mb", type=opt.positive_megabytes, default=268.435456, help="largest coalesced read, MB")
    r.add_argument("--buffered", action="store_true", help="relayout's read path: buffered weight reads instead of O_DIRECT")
    r.add_argument("--dense-ms", type=opt.milliseconds, default=1.0, help="per-layer compute before routing, ms"
                                                            + ("" if modelled else " (slept)"))
    r.add_argument("--compute-gbps", type=opt.rate_gbps, help="expert matmul rate, GB (1e9 bytes) of expert weights per second "
                   "per position (default 50, or the run's own with --runtime-env-from; measure it from colibrì's PROF=1 "
                   "P0-EXEC line, 'routed CPU <s>s / <GB/s>')" + ("" if modelled else " (slept)"))
    r.add_argument("--prefetch", type=_prefetch_setting if modelled else str, default="none",
                   choices=None if modelled else PREFETCH_SOURCES, metavar="SOURCE" if modelled else None,
                   help="prefetch source for the next layer: none (colibrì's default), oracle (its true experts, a bound), "
                        "coupled (cross-layer pair counts of the training sessions, like COUPLE"
                        + ("); replay only, NEEDING A RUNTIME CHANGE: heat, persistence, session (probability sources "
                           "learned on the training "
                           "sessions), or several of coupled, heat, persistence, session joined by '+' (e.g. "
                           "coupled+persistence: their probabilities fused by a log-odds regression learned on the "
                           "training sessions; needs --policy)" if modelled else "; needs --layout)"))
    r.add_argument("--prefetch-experts", type=opt.integer(1, 64), default=6, help="experts the prefetcher loads per layer (K, 1-64)")
    if modelled:
        r.add_argument("--pin-gb", type=opt.gigabytes, default=0.0, help="pin the hottest experts (training heat), GB")
        r.add_argument("--other-ms", type=opt.milliseconds, default=0.0, help="other overhead per token (O in TPOT), ms")


def _colibri_run_options(r) -> None:
    """The options naming the colibrì run a model describes (its variables, a run's output, its page cache)."""
    r.add_argument("--runtime-env", metavar="'VAR=VALUE ...'",
                   help="the colibrì run to model, in its own variables (PIPE, PIPE_WORKERS, URING, DIRECT, CAP, "
                        "CAP_RAISE, RAM_GB, PIN_GB, OMP_NUM_THREADS; docs/ENGINE_MODEL.md). Default, unless --workers, "
                        "--batched or --buffered choose relayout's own read path: the engine's Linux default (PIPE=0: "
                        "each layer's misses loaded by the OpenMP team while the compute thread waits; buffered reads)")
    r.add_argument("--runtime-env-from", metavar="RUN.txt",
                   help="model the configuration a colibrì run printed (a file of its stdout+stderr with PROF=1, or a "
                        "directory of stdout.txt and stderr.txt: the [PROF] "
                        "config line, its LRU cap, OpenMP team, the rate its threads copied page-cache hits (its DISK-CLASS "
                        "line's warm reads, when all buffered) and, unless --compute-gbps, its matmul rate); "
                        "--runtime-env adds to it")
    r.add_argument("--pilot-precision", type=opt.number(0.0, 1.0, lo_open=True), metavar="P",
                   help="PILOT_REAL=1: the share of the router pilot's predictions the next layer routes, 0-1 (default: "
                        "the 'next layer (PILOT, stale)' line of a --runtime-env-from run made with LOOKA=1); its "
                        "predictions are in no routing trace, so the model draws them at this precision")
    r.add_argument("--page-cache-gb", type=opt.gigabytes,
                   help="memory the kernel's page cache keeps experts' pages in (weights and scales) under buffered "
                        "reads (DIRECT=0), GB (default: what a --runtime-env-from run left of its available memory, "
                        "else 0: every buffered weight read reaches the drive)")


def engine_device(args, device, layout):
    """``device`` with page-cache copies at the rate the ``--runtime-env-from`` run's threads
    copied at (:func:`replay.colibri.engine_config.engine_copy_rate`), on ``layout`` (the
    container that run read), when it printed one (:func:`replay.colibri.engine_config.at_engine_copy_rate`);
    else ``device``."""
    source = getattr(args, "runtime_env_from", None)
    if not source or layout is None or not hasattr(device, "unaligned_memory_bandwidth"):
        return device
    from replay.colibri.engine_config import at_engine_copy_rate, config_from_run, engine_copy_rate

    cfg, facts = config_from_run(source)
    rate = engine_copy_rate(cfg, facts, layout)
    return at_engine_copy_rate(device, rate, layout) if rate else device


def handoff_note(config, device) -> None:
    """Say on stderr when ``config`` hands loads to PIPE=1's pool on the compute thread's core and
    ``device`` did not measure what that costs (:data:`replay.colibri.openmp_team.HANDOFF_NOTE`)."""
    from replay.colibri.openmp_team import HANDOFF_NOTE

    if config.loaders_on_compute_core and device.loader_handoff is None:
        print(f"relayout: the device profile {device.name} {HANDOFF_NOTE}", file=sys.stderr)


def runtime_config(args, layout=None):
    """The model's configuration the options of :func:`runtime_options` describe
    (:func:`relayout.planning.replay_setup.runtime_config`; ``layout`` sizes a colibrì run's LRU from CAP and RAM_GB)."""
    from relayout.planning.replay_setup import RuntimeRequest
    from relayout.planning.replay_setup import runtime_config as config_of

    request = RuntimeRequest(
        ram_gb=getattr(args, "ram_gb", 0.0), workers=args.workers, batched=args.batched, coalesce=args.coalesce,
        coalesce_max_mb=args.coalesce_max_mb, buffered=args.buffered, pin_gb=getattr(args, "pin_gb", 0.0),
        dense_ms=args.dense_ms, compute_gbps=args.compute_gbps, other_ms=getattr(args, "other_ms", 0.0),
        prefetch=getattr(args, "prefetch", "none"), prefetch_experts=getattr(args, "prefetch_experts", 6),
        prefetch_budget_mb=getattr(args, "prefetch_budget_mb", 0.0),
        source_caps=tuple(getattr(args, "source_caps", None) or ()),
        colibri_run=hasattr(args, "runtime_env_from"), runtime_env=getattr(args, "runtime_env", None),
        runtime_env_from=getattr(args, "runtime_env_from", None), page_cache_gb=getattr(args, "page_cache_gb", None),
        pilot_precision=getattr(args, "pilot_precision", None),
    )
    config = config_of(request, layout)
    if layout is not None and config.engine_env and not config.direct and not request.runtime_env_from:
        experts = float(layout.expert_bytes().sum())
        if 0 < config.page_cache_bytes < experts:
            print(f"relayout: the page cache for experts ({config.page_cache_bytes / 1e9:.3g} GB) holds less than the "
                  f"container's experts ({experts / 1e9:.3g} GB): its hits are timed at the device profile's copy "
                  "rate, which on the machine of docs/BENCHMARKS.md was 1.7-3.9x colibrì's own (docs/ENGINE_MODEL.md, "
                  "'Where the page cache cannot hold the experts'); give --runtime-env-from a PROF=1 run of colibrì "
                  "on this machine, or measure with relayout measure --engine", file=sys.stderr)
    return config


def rewrite_options(c: argparse.ArgumentParser, src_flag: bool) -> None:
    """Where a rewrite writes, from which manifest, and whether without a passing gate (``src_flag``:
    the source is ``--container``, and the rewrite optional)."""
    w = c.add_argument_group("rewrite")
    if src_flag:
        w.add_argument("--container", metavar="SRC", help="on a pass, rewrite this container (needs --out)")
    w.add_argument("--out", metavar="DST", required=not src_flag, help="destination of the rewritten container")
    w.add_argument("--manifest", help=f"SRC's manifest (default SRC/{MANIFEST_NAME}; hashed now if absent)")
    w.add_argument("--force", action="store_true", help="rewrite even without a passing gate (recorded in DST's manifest)")
