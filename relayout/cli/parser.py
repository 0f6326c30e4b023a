"""The ``relayout`` argument parser: the top level and every command, in the order ``relayout
--help`` lists them; each command group declares its own arguments (``parser_*`` modules).
"""

from __future__ import annotations

import argparse

from relayout import __version__
from . import options as opt
from .arguments import HelpWithDefaults
from .parser_containers import add_drives, add_inspect, add_manifest, add_rewrite, add_verify
from .parser_measurement import add_calibrate, add_compare, add_measure, add_report
from .parser_planning import add_export, add_plan, add_synth, add_trace
from .parser_replay import add_gate, add_placement, add_replay, add_split_curve
from .parser_workflows import add_demo, add_validate

COMMANDS = (
    add_inspect, add_synth, add_trace, add_export, add_plan, add_replay, add_placement, add_split_curve, add_drives,
    add_gate, add_rewrite, add_calibrate, add_validate, add_measure, add_report, add_compare, add_verify, add_manifest,
    add_demo,
)
"""Each adds its commands to the subparsers, in the order the help lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The ``relayout`` parser: each command's arguments, and its function as ``func``.

    Returns
    -------
    argparse.ArgumentParser
        Usage errors are one line on stderr and exit status 2 (:class:`relayout.cli.options.OneLineParser`).
    """
    p = opt.OneLineParser(
        prog="relayout", formatter_class=HelpWithDefaults,
        description="Co-activation layouts for MoE expert containers streamed from NVMe: plan, replay and gate, "
                    "rewrite, verify, measure. Every bad input is one line on stderr and exit status 2.",
    )
    p.add_argument("--version", action="version", version=f"relayout {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return p
