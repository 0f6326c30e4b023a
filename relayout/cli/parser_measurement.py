"""The measurement commands' arguments: ``calibrate``, ``measure``, ``report`` and ``compare``;
their functions are in :mod:`relayout.cli.commands_measurement`.
"""

from __future__ import annotations

from replay.evaluation.evidence import MIN_SESSIONS
from replay.physical.buffers import BUFFER_KINDS

import relayout.cli.commands_measurement as commands

from . import options as opt
from .arguments import command, runtime_options


def add_calibrate(sub) -> None:
    """``calibrate``."""
    s = command(sub, "calibrate", "measure the device holding PATH and fit a device profile", commands.cmd_calibrate)
    s.add_argument("path", help="a directory (a temporary test file is written there) or a large file")
    s.add_argument("-o", "--output", required=True, metavar="device.json", help="the profile to write")
    s.add_argument("--size-mb", type=opt.integer(64, 1 << 30), default=1024, help="test file size when PATH is a directory, MiB (>= 64)")
    s.add_argument("--seconds", type=opt.number(0.05, 60.0), default=0.4, help="time per (request size, queue depth) cell (0.05-60)")
    s.add_argument("--name", help="profile name (default: from PATH)")
    s.add_argument("--buffers", choices=BUFFER_KINDS, default="engine",
                   help="read into buffers as colibri's (engine: no huge pages asked for, so with O_DIRECT a request is "
                        "at most max_segments base pages unless transparent_hugepage is always) or the relayout "
                        "harness's (huge-pages: MADV_HUGEPAGE, requests up to max_sectors_kb); default: engine")


def add_measure(sub) -> None:
    """``measure``: the engine's runs or the Python emulation."""
    s = command(sub, "measure", "run the colibrì engine cold and keep its output (--engine), or emulate the runtime's "
                                "read path in Python and write a STALL_TRACE (--trace)", commands.cmd_measure)
    s.add_argument("--container", required=True, help="the container to read")
    s.add_argument("--trace", help="emulation: a relayout trace whose routing is replayed for real")

    engine_options(s)
    s.add_argument("--layout", metavar="PLAN.json", help="evaluate only sessions this plan did not train on")
    s.add_argument("--tokens", type=opt.positive_count, help="stop after this many held-out steps (default: all)")
    runtime_options(s, modelled=False)
    s.add_argument("--warm", action="store_true", help="do not drop the page cache first")
    s.add_argument("--no-trace", action="store_true", help="record nothing (to measure tracing overhead)")
    s.add_argument("--run-id", help="run id written in every record (default: unique, from the container and "
                                    "layout names and the start time)")
    s.add_argument("-o", "--output", help="STALL_TRACE JSONL to write (.zst compresses); with --engine, the directory "
                                          "the runs are kept in")


def add_report(sub) -> None:
    """``report``, and the hypothesis tables of measured runs."""
    s = command(sub, "report", "stall per committed token (S) and what makes it up (hit rate, reads per token, step stall "
                               "percentiles, queue depth), from STALL_TRACE files or colibrì runs' output", commands.cmd_report)
    s.add_argument("runs", nargs="+", help="STALL_TRACE files (.jsonl or .jsonl.zst), or colibrì runs: output files, "
                                           "measured run directories, or directories of them (one arm each)")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--plots", metavar="DIR", help="write PNG figures (needs the 'plots' extra: matplotlib)")
    s.add_argument("--predicted", metavar="gate.json", help="with --plots: add predicted vs measured S")
    h = s.add_argument_group("hypotheses (the tables of replay --policy, from measured runs)")
    h.add_argument("--hypothesis", choices=("H2", "H3a", "H3b", "H5"),
                   help="judge a hypothesis (H2 admission, H3a placement, H3b whole vs split experts, H5 prefetch budgets) on the runs: each run's configuration (or run id) is an arm; H2 needs "
                        "none and stall-value, H3a stall-value and frequency, H3b whole@GB and split@GB at each RAM "
                        "budget (GB), H5 default and tail-control")
    h.add_argument("--arm", action="append", metavar="ARM=CONFIGURATION",
                   help="name the arm a configuration label stands for (repeatable)")
    h.add_argument("--min-sessions", type=opt.positive_count, default=MIN_SESSIONS, help="units (repetition x request) a verdict needs")


def add_compare(sub) -> None:
    """``compare``."""
    s = command(sub, "compare", "paired comparison of STALL_TRACE files or of colibrì runs (first = control)", commands.cmd_compare)
    s.add_argument("runs", nargs="+", help="STALL_TRACE files, or colibrì arms (a directory of one container's runs, "
                                           "or output files); the first is the control. A STALL_TRACE file is one "
                                           "configuration: its runs (repetitions; concatenate several runs' files) pair "
                                           "by order with the other files' runs, and an interval needs at least 2 pairs")
    s.add_argument("--json", action="store_true", help="print JSON")


def engine_options(c) -> None:
    """``measure``'s options for running the real engine."""
    g = c.add_argument_group("the real engine (measure --engine)")
    g.add_argument("--engine", metavar="PATH", help="the colibrì binary: run it cold per prompt and repetition, keep its "
                                                    "output, routing trace and record per run under -o DIR")
    g.add_argument("--baseline", metavar="DIR", help="a second container (the stock one), run interleaved with "
                                                     "--container as the control arm")
    g.add_argument("--prompts", metavar="FILE", help="prompts, one per non-empty line (UTF-8)")
    g.add_argument("--reps", type=int, default=3, help="repetitions of every prompt on every container")
    g.add_argument("--runtime-env", metavar="'NAME=value ...'", default="",
                   help="the run configuration in the engine's own variables, e.g. 'PIPE=1 DIRECT=1 CAP=4 CAP_RAISE=0'")
    g.add_argument("--baseline-env", metavar="'NAME=value ...'", default="",
                   help="variables for the --baseline arm only, over --runtime-env (e.g. its own COLI_MODEL_DIRS)")
    g.add_argument("--container-env", metavar="'NAME=value ...'", default="",
                   help="variables for the --container arm only, over --runtime-env (e.g. its own COLI_MODEL_DIRS)")
    g.add_argument("--ngen", type=int, default=32, help="tokens generated per run (NGEN)")
    g.add_argument("--timeout", type=float, help="kill a run after this many seconds (recorded as exit status -9)")
