"""What commands print beside their tables: a note on stderr, a rewrite's summary of the files
around the tensors, and ``verify``'s report with its exit status (shared by ``replay``,
``rewrite`` and ``verify``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from containers.container import Container

from relayout.render.containers import format_rewrite_files, format_verify


def say(line: str) -> None:
    """One ``relayout:`` line on stderr (progress and advice, apart from the command's output)."""
    print(f"relayout: {line}", file=sys.stderr)


def print_rewrite_files(dst, manifest: dict, dirs: list[str] = ()) -> None:
    """The rewrite's summary of the files around the tensors, one indented line each (``dirs``:
    the split directories after ``dst``, whose shards' stamps count too)."""
    from containers.model_index import INDEX_NAME

    c = Container.open(dst, dirs)
    for line in format_rewrite_files(manifest, len(c.stamps), (Path(dst) / INDEX_NAME).is_file()):
        print(f"  {line}")


def verify_and_report(src, dst, full: bool, as_json: bool, dirs: list[str] | None = None) -> int:
    """Verify ``dst`` against ``src`` (bytes too with ``full``; ``dirs``: the split directories after
    ``dst``, ``None`` for those its manifest records), print the report (JSON with ``as_json``) and
    return the exit status: 0, or 2 when verify found a problem."""
    from relayout.workflows.apply import verify

    problems, summary = verify(src, dst, full, dirs=dirs)
    if as_json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_verify(src, dst, problems, summary, full))
    if problems:
        print(f"relayout: error: {dst}: {len(problems)} problem(s) found by verify", file=sys.stderr)
        return 2
    return 0
