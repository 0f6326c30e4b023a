"""The container commands' arguments: ``inspect``, ``drives``, ``mirror``, ``rewrite``, ``verify``
and ``manifest``; their functions are in :mod:`relayout.cli.commands_containers` (``drives`` and
``mirror``: :mod:`relayout.cli.commands_drives`).
"""

from __future__ import annotations

from containers.container import MANIFEST_NAME

import relayout.cli.commands_containers as commands

from . import commands_drives as drives_command
from .arguments import command, rewrite_options


def add_inspect(sub) -> None:
    """``inspect``."""
    s = command(sub, "inspect", "summarise a container: files, experts, formats, fast path, problems", commands.cmd_inspect)
    s.add_argument("dir", help="the model directory (safetensors shards and config.json)")
    s.add_argument("--json", action="store_true", help="print JSON")


def add_drives(sub) -> None:
    """``drives`` and ``mirror``."""
    s = command(sub, "drives", drives_command.HELP, drives_command.cmd_drives)
    drives_command.add_arguments(s)
    s = command(sub, "mirror", drives_command.MIRROR_HELP, drives_command.cmd_mirror)
    drives_command.add_mirror_arguments(s)


def add_rewrite(sub) -> None:
    """``rewrite``."""
    s = command(sub, "rewrite", "stream-rewrite a container into the plan's layout (needs a passing gate)", commands.cmd_rewrite)
    s.add_argument("src", help="the source container (opened read-only)")
    s.add_argument("--layout", required=True, metavar="PLAN.json", help="the plan to write")
    s.add_argument("--gate", help="gate.json from relayout replay")
    s.add_argument("--verify", action="store_true", help="verify DST against SRC afterwards")
    s.add_argument("--storage", metavar="STORAGE.json", help="write each shard straight into the directory of its drive, as "
                                                              "this description (relayout drives --out) splits them: its "
                                                              "first directory's shards and every other file into DST")
    s.add_argument("--dirs", nargs="+", default=[], metavar="DIR", help="with --storage: the directories of its split after "
                                                                        "the primary, in its order (COLI_MODEL_DIRS)")
    rewrite_options(s, src_flag=False)


def add_verify(sub) -> None:
    """``verify``."""
    s = command(sub, "verify", "prove DST equals SRC tensor by tensor and meets the runtime's constraints", commands.cmd_verify)
    s.add_argument("src", help="the source container")
    s.add_argument("dst", help="the rewritten container")
    s.add_argument("--full", action="store_true", help="also compare bytes, not only xxh3-128")
    s.add_argument("--dirs", nargs="+", metavar="DIR", help="DST is split: its other directories in COLI_MODEL_DIRS order, "
                                                            "read as the engine reads them (default: those DST's manifest "
                                                            "records for a split rewrite)")
    s.add_argument("--json", action="store_true", help="print JSON")


def add_manifest(sub) -> None:
    """``manifest``."""
    s = command(sub, "manifest", "write or check the xxh3-128 checksum manifest of a container", commands.cmd_manifest)
    s.add_argument("dir", help="the container")
    s.add_argument("-o", "--output", help=f"manifest path (default DIR/{MANIFEST_NAME})")
    s.add_argument("--check", action="store_true", help="re-hash and name every mismatch")
