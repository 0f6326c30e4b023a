"""A kept ``validation.json`` judged again by the present rules of ``relayout validate``.

Usage: python benchmarks/rejudge_validation.py VALIDATION_JSON [...]

Each record's measurements and predictions are judged afresh
(:func:`relayout.validate.judge_record`: family-wise intervals, the chance allowance, the
placement control) and its tables and summary printed, with the verdict the record carried
before. This is how docs/BENCHMARKS.md ("A verdict that holds against chance and placement")
set the runs of the day side by side under one rule.
"""

from __future__ import annotations

import json
import sys

from relayout.render import format_validation
from relayout.validate import judge_record


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        judged = judge_record(record)
        print(f"== {path} (version {record['version']}): the record said {record['summary']['verdict']!r}, the present "
              f"rules say {judged['summary']['verdict']!r}\n")
        print(format_validation(judged))
        print()
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
