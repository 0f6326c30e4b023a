"""The replay commands' arguments: ``replay`` (gate, sweep, hypothesis tables, rewrite),
``placement``, ``split-curve`` and ``gate``; their functions are in
:mod:`relayout.cli.commands_replay`.
"""

from __future__ import annotations

from containers.jsonfile import shipped_names
from replay.evaluation.evidence import DEFAULT_THRESHOLD, MIN_SESSIONS

import relayout.cli.commands_replay as commands

from . import options as opt
from .arguments import command, rewrite_options, runtime_options, scheduler_option


def _device_help() -> str:
    return f"a shipped profile ({', '.join(shipped_names('devices'))}) or a profile JSON"


def add_replay(sub) -> None:
    """``replay``: the plan and trace, the device, the runtime, the gate, the sweep, the hypothesis
    tables and the rewrite."""
    s = command(sub, "replay", "replay held-out routing through baseline and plan layouts; gate the rewrite", commands.cmd_replay)
    s.add_argument("--layout", required=True, metavar="PLAN.json",
                   help="the plan to evaluate; the pin set it carries (relayout placement --plan-out), if any, is pinned "
                        "in both layouts, and --pin-gb is then refused")
    s.add_argument("--trace", required=True,
                   help="a relayout trace file (relayout trace import); sessions the plan trained on are excluded. The gate "
                        "and --sweep stream its rows from the file (memory flat in trace length); --policy and "
                        "--hypotheses load it into memory")
    d = s.add_mutually_exclusive_group(required=True)
    d.add_argument("--device", help=_device_help())
    d.add_argument("--storage", metavar="STORAGE.json", help="several independent drives (relayout drives --out writes one; "
                                                            "docs/MULTI_DRIVE.md); a layout it does not list is split "
                                                            "evenly by name over its split drives")
    runtime_options(s, modelled=True)
    g = s.add_argument_group("gate")
    g.add_argument("--baseline", default="stock", help="'stock' (the source layout) or another plan JSON")
    g.add_argument("--threshold", type=opt.fraction, default=DEFAULT_THRESHOLD, help="fraction of baseline TPOT the interval's low end must save")
    g.add_argument("--tpot-from", metavar="RUN.jsonl",
                   help="take TPOT's compute and other time per token from a measured STALL_TRACE (relayout measure), "
                        "so the threshold is relative to a TPOT you recognise (default: the compute model and --other-ms)")
    g.add_argument("--min-sessions", type=opt.positive_count, default=MIN_SESSIONS,
                   help="held-out sessions a verdict needs; with fewer the verdict is 'insufficient' (steps are then "
                        "resampled in blocks)")
    g.add_argument("--strict", action="store_true",
                   help=f"exit {commands.EXIT_FAIL} when the gate fails and {commands.EXIT_INSUFFICIENT} when the evidence "
                        "is insufficient (default: exit 0 whatever the verdict)")
    g.add_argument("-o", "--output", help="write gate.json (or the sweep table as JSON)")
    g.add_argument("--json", action="store_true", help="print JSON")
    w = s.add_argument_group("sweep")
    w.add_argument("--sweep", action="store_true", help="regime map over RAM budgets x workers x coalesce")
    w.add_argument("--sweep-ram", type=opt.numbers(0.0, opt.GB_MAX),
                   help="RAM budgets for --sweep, GB, comma-separated (default: 0, 1/8, 1/4 and 1/2 of the model's routed "
                        "expert bytes, and --ram-gb when given)")
    w.add_argument("--sweep-workers", type=opt.numbers(1, 1024, whole=True), default="1,2,8,16", help="worker counts for --sweep")
    scheduler_option(w, "the sweep's cells (one task per cell)")
    _hypothesis_options(s)
    rewrite_options(s, src_flag=True)


def _hypothesis_options(s) -> None:
    """``replay``'s stall-valued control: the hypothesis tables instead of the gate."""
    h = s.add_argument_group("stall-valued control (hypothesis tables instead of the gate: H2 admission, H3a placement, "
                             "H3b whole vs split experts, H5 prefetch budgets; NEEDS A RUNTIME "
                             "CHANGE: colibrì has no admission control or prefetch budgets)")
    h.add_argument("--policy", metavar="NAME[,NAME...]",
                   help="admission policies to compare with stall-value at equal budgets (probability, per-byte, deadline, "
                        "stall-value, oracle, or 'all'); over --prefetch's source (coupled when none); prints H2's table, "
                        "with --sweep every hypothesis over --sweep-ram x --sweep-budgets-mb")
    h.add_argument("--hypotheses", metavar="H[,H...]", help="which tables: H2, H3a, H3b, H5 (default: H2; with --sweep all four)")
    h.add_argument("--prefetch-budget-mb", type=opt.megabytes, default=0.0,
                   help="speculative bytes admitted per layer (B), MB; 0 = only the queue-slot budget --prefetch-experts limits")
    h.add_argument("--sweep-budgets-mb", type=opt.numbers(0.0, opt.MB_MAX), help="speculative-byte budgets for --sweep --policy, MB per layer "
                                              "(default: half and all of --prefetch-experts experts' worth)")
    h.add_argument("--source-caps", type=opt.numbers(0.0, 1.0), metavar="SHARE[,SHARE...]",
                   help="per-source caps for --prefetch a+b: the most of B and of --prefetch-experts each source's "
                        "candidates take per layer, one share (0-1) per source in --prefetch's order (default: no caps; "
                        "H5's source-caps arm: equal shares)")


def add_placement(sub) -> None:
    """``placement``: the arms at equal RAM and the pin set it exports."""
    s = command(sub, "placement", "placement arms at equal RAM (LRU, frequency pins, hybrid, probability per byte, "
                                  "stall value per byte): S and hit rate on held-out sessions; export the pin set",
                commands.cmd_placement)
    s.add_argument("--layout", required=True, metavar="PLAN.json", help="the plan whose layout and training sessions are used")
    s.add_argument("--trace", required=True, help="a relayout trace: the plan's training sessions choose pins, the rest evaluate")
    s.add_argument("--device", required=True, help=_device_help())
    runtime_options(s, modelled=True)
    a = s.add_argument_group("arms")
    a.add_argument("--arms", help="comma-separated arms (default: lru,frequency,hybrid,probability-per-byte,stall-value)")
    a.add_argument("--pin-share", type=opt.fraction, default=0.5,
                   help="share of --ram-gb the frequency, hybrid and probability arms pin (colibrì's default: half); "
                        "the stall-value arm searches it")
    a.add_argument("--half-life", type=opt.number(0.0, 1e12, lo_open=True), help="hybrid arm: half-life of a selection's weight, training steps "
                                                   "(default: a quarter of the training steps)")
    a.add_argument("--min-sessions", type=opt.positive_count, default=MIN_SESSIONS, help="held-out sessions a comparison needs")
    o = s.add_argument_group("output")
    o.add_argument("--export", default="stall-value", help="the arm whose pins --pin-file and --plan-out write")
    o.add_argument("--pin-file", metavar="PIN.txt", help="write that arm's pins as colibrì's PIN file (layer expert rank lines)")
    o.add_argument("--plan-out", metavar="PLAN.json", help="write a copy of the plan recording that arm's pins (a new plan digest)")
    o.add_argument("-o", "--output", help="write the arms' table as JSON")
    o.add_argument("--json", action="store_true", help="print JSON")


def add_split_curve(sub) -> None:
    """``split-curve``: S versus RAM, whole and split experts."""
    s = command(sub, "split-curve", "S versus RAM for whole experts and for split experts (ratio and per-layer top budget "
                                    "chosen by replayed stall), on held-out sessions", commands.cmd_split_curve)
    s.add_argument("--layout", required=True, metavar="PLAN.json", help="a plan without a split: its layout and training sessions")
    s.add_argument("--trace", required=True, help="a relayout trace: the plan's training sessions search, the rest evaluate")
    s.add_argument("--device", required=True, help=_device_help())
    runtime_options(s, modelled=True, ram=False)
    c = s.add_argument_group("curve")
    c.add_argument("--ram-gb", dest="ram_budgets_gb", type=opt.numbers(0.0, opt.GB_MAX), required=True, help="RAM budgets, GB, comma-separated (the curve's x axis)")
    c.add_argument("--ratios", type=opt.numbers(0.0, 1.0), default="0.125,0.25,0.375,0.5", help="split ratios searched (FFN share of the top; 0 = no split "
                                                                   "is always searched)")
    c.add_argument("--top-shares", type=opt.numbers(0.0, 1.0), default="0.25,0.5,0.75,1", help="shares of each budget for resident tops searched "
                                                                  "(the LRU holds whole experts in the rest)")
    c.add_argument("--min-sessions", type=opt.positive_count, default=MIN_SESSIONS, help="held-out sessions a comparison needs")
    c.add_argument("-o", "--output", help="write both curves as JSON")
    c.add_argument("--json", action="store_true", help="print JSON")


def add_gate(sub) -> None:
    """``gate --recheck``."""
    s = command(sub, "gate", "recompute a gate record's interval and verdict from the evidence it stores", commands.cmd_gate)
    s.add_argument("--recheck", required=True, metavar="gate.json", help="the gate record to recheck")
