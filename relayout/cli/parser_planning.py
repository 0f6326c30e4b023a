"""The planning commands' arguments: ``synth`` (container, trace), ``trace`` (import, stats),
``export`` (coli-pairs) and ``plan``; their functions are in :mod:`relayout.cli.commands_planning`.
"""

from __future__ import annotations

from containers.container import MANIFEST_NAME
from containers.geometry import geometry_names
from replay.formats.planfile import METHODS

import relayout.cli.commands_planning as commands

from . import options as opt
from relayout.planning.coactivation import WEIGHTS
from relayout.planning.packing import DEFAULT_ALIGNMENT
from relayout.planning.split import RULES
from ..traces.importer import TRACE_FORMATS
from ..traces.synth import atlas_names
from .arguments import command, geometry_options, scheduler_option


def add_synth(sub) -> None:
    """``synth container`` and ``synth trace``."""
    geometries = ", ".join(geometry_names())
    s = command(sub, "synth", "generate synthetic containers and routing traces")
    synth = s.add_subparsers(dest="what", required=True, metavar="WHAT")
    c = command(synth, "container", "write a synthetic container laid out like the colibrì converter's output",
                commands.cmd_synth_container)
    c.add_argument("out", help="the new directory")
    c.add_argument("--geometry", required=True, help=f"one of {geometries} or a geometry JSON file")
    geometry_options(c)
    c.add_argument("--shard-mb", type=opt.positive_megabytes, help="target shard size in MB, 10^6 bytes (default: the geometry's)")
    c.add_argument("--seed", type=opt.seed, default=0, help="seed of the tensor bytes and the shard cuts")
    c.add_argument("--sparse", action="store_true", help="sparse files: real headers, each tensor a 4 KiB seeded stamp "
                                                         "then holes (zeros); a full-size container in a few GB of disk")
    c.add_argument("--stamp", action="store_true", help="stamp the format of every quantised tensor that is not a routed "
                                                        "expert in its shard's __metadata__[\"colibri.fmt\"], as colibrì's "
                                                        "repack tool does")

    c = command(synth, "trace", "write a synthetic routing trace with real structure", commands.cmd_synth_trace)
    c.add_argument("out", help="the trace file to write (.rt)")
    c.add_argument("--geometry", required=True, help=f"one of {geometries} or a geometry JSON file")
    geometry_options(c, full=False)
    c.add_argument("--tokens", type=opt.positive_count, default=2000, help="decode tokens in all")
    c.add_argument("--sessions", type=opt.positive_count, default=8, help="sessions the tokens are split into")
    c.add_argument("--seed", type=opt.seed, default=0, help="seed of the routing")
    c.add_argument("--fit", metavar="ATLAS", help="fit heat and lift to a co-activation atlas and report the error: a shipped "
                                              f"atlas ({', '.join(atlas_names())}) or an atlas JSON file")


def add_trace(sub) -> None:
    """``trace import`` and ``trace stats``."""
    geometries = ", ".join(geometry_names())
    s = command(sub, "trace", "import routing traces and describe them")
    tsub = s.add_subparsers(dest="what", required=True, metavar="WHAT")
    c = command(tsub, "import", "convert ROUTE_TRACE / STALL_TRACE / MBLT / .coli_usage into a relayout trace",
                commands.cmd_trace_import)
    c.add_argument("inputs", nargs="+", help="input files; each is one session, in the order given")
    c.add_argument("-o", "--output", required=True, help="the trace file to write (.rt)")
    c.add_argument("--format", choices=TRACE_FORMATS, help="input format (default: sniffed from the first bytes)")
    c.add_argument("--geometry", help=f"check expert ids and layers against this geometry ({geometries} or a JSON file) "
                                      "and record its name")
    c.add_argument("--runtime-output", action="append", metavar="FILE",
                   help="colibrì's saved output (stdout, or stdout and stderr) of an input's run, one per input in the same "
                        "order: its decode forwards and tokens (a serve process's: each turn's) are checked against the "
                        "ROUTE_TRACE and its tokens become the committed tokens (without it, n-gram verify steps are "
                        "assumed to commit 1)")
    c.add_argument("--split", metavar="prefill|N",
                   help="cut each ROUTE_TRACE into sessions: 'prefill' at each new prompt (a forward wider than a decode "
                        "step; an n-gram drafting run needs --runtime-output for its draft depth), or N: every N committed "
                        "tokens (default: one session per file)")
    c = command(tsub, "stats", "heat entropy, lift, cross-layer lift, reuse distance per layer", commands.cmd_trace_stats)
    c.add_argument("trace", help="a relayout trace (.rt)")
    c.add_argument("--json", action="store_true", help="print JSON")


def add_export(sub) -> None:
    """``export coli-pairs``."""
    s = command(sub, "export", "export tables for the runtime")
    esub = s.add_subparsers(dest="what", required=True, metavar="WHAT")
    c = command(esub, "coli-pairs", "cross-layer coupling table in colibrì's .coli_pairs format",
                commands.cmd_export_coli_pairs)
    c.add_argument("trace", help="a relayout trace (.rt)")
    c.add_argument("-o", "--output", required=True, help="the .coli_pairs file to write")


def add_plan(sub) -> None:
    """``plan``: its traces, what the plan is for, ordering, packing and the vertical split."""
    geometries = ", ".join(geometry_names())
    s = command(sub, "plan", "cluster, order and pack: write plan.json", commands.cmd_plan)
    s.add_argument("--trace", required=True, action="append",
                   help="a relayout trace (.rt); the first --train-fraction of its sessions train. Repeat it, or give a "
                        "directory (its *.rt files) or a quoted glob, to pool many traces: each file is split by "
                        "--train-fraction on its own and counted as one task (see --scheduler)")
    s.add_argument("-o", "--output", required=True, help="plan.json to write")
    src = s.add_argument_group("what the plan is for (exactly one)")
    src.add_argument("--container", help="the container the plan is for")
    src.add_argument("--manifest", help=f"its manifest (default DIR/{MANIFEST_NAME}; hashed now if absent)")
    src.add_argument("--geometry", help=f"plan for a geometry's converter layout instead ({geometries} or a JSON file)")
    src.add_argument("--source-shard-mb", type=opt.positive_megabytes, help="with --geometry: the source's shard size, MB (as given to synth)")
    src.add_argument("--synth-seed", type=opt.seed, default=0, help="with --geometry: seed of the synthetic container it mirrors")
    geometry_options(s)
    m = s.add_argument_group("ordering")
    m.add_argument("--method", default="louvain", choices=METHODS, help="how each layer's experts are ordered")
    m.add_argument("--train-fraction", type=opt.number(0.0, 1.0, lo_open=True), default=0.7, help="first fraction of sessions to learn from")
    m.add_argument("--seed", type=opt.seed, default=0, help="seed of Louvain and the random baseline")
    m.add_argument("--resolution", type=opt.number(0.0, 1e6, lo_open=True), default=1.0, help="Louvain resolution")
    m.add_argument("--weight", default="count", choices=WEIGHTS, help="co-activation edge weight")
    m.add_argument("--min-support", type=opt.positive_count, default=1, help="minimum co-selections for an edge")
    scheduler_option(m, "pooled counting (one task per trace file; a single trace is counted in this process)")
    k = s.add_argument_group("packing")
    k.add_argument("--shard-mb", type=opt.positive_megabytes, default=4000, help="target size of new shards, MB")
    k.add_argument("--alignment", type=opt.integer(1, 1 << 30), default=DEFAULT_ALIGNMENT, help="block alignment in bytes (e.g. a RAID chunk size)")
    k.add_argument("--scales-with-weights", action="store_true", help="put each expert's scales right after its weights")
    v = s.add_argument_group("vertical split")
    v.add_argument("--split-ratio", type=opt.number(0.0, 1.0, lo_open=True), help="fraction of the FFN in the top segment (default: no split)")
    v.add_argument("--split-ram-gb", type=opt.gigabytes, help="RAM for resident top segments, GB (needed with --split-ratio)")
    v.add_argument("--split-rule", default="stall", choices=RULES,
                   help="rank tops by heat per byte, closed-form stall per byte, or replayed wait per byte")
    v.add_argument("--cache-gb", type=opt.gigabytes, help="LRU cache the split competes with, GB (stall and replay rules; default 0)")
    v.add_argument("--split-device", default="mac-pro-2019-applraid-4x", help="device profile for the replay rule")
    v.add_argument("--split-workers", type=opt.integer(1, 1024), default=8, help="reader workers for the replay rule")
