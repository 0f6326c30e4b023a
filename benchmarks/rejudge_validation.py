"""The kept ``relayout validate`` runs (``benchmarks/records/*.validation.json``) judged again by the present rules.

Usage:
    python benchmarks/rejudge_validation.py                 # check every kept run against its expected file
    python benchmarks/rejudge_validation.py --regenerate    # write the expected files from the present rules
    python benchmarks/rejudge_validation.py --show RECORD [...]   # print a record's tables and summary, judged again

A record holds the measurements and predictions of one run on a real disk; its verdict is a pure
function of them (:func:`relayout.workflows.validation.record.judge_record`). Each kept record is
brought to the present record form (:func:`present_form`: the fields an older relayout did not
record are None, as the present one records a figure it could not measure) and judged again; the
judgements (every cell's and saving's agreement) and the whole summary, text included, are
compared with ``benchmarks/records/expected/<run>.json``. A change to the rules that moves one of
them is a change to the published evidence (docs/BENCHMARKS.md): rerun with ``--regenerate``, look
at the diff of the expected files, and say so in docs/BENCHMARKS.md. The kept device profiles
(``*.device.json``) are checked too: each is one a kept run used, with the same drive.
Exit status 0 when everything matches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from relayout.render.validation import format_validation  # noqa: E402
from relayout.workflows.validation.record import VALIDATION_VERSION, judge_record  # noqa: E402
from relayout.workflows.validation.rules import DIAGNOSES  # noqa: E402
from replay.model.device import load_device  # noqa: E402

RECORDS = ROOT / "benchmarks" / "records"
EXPECTED = RECORDS / "expected"
CELL_FIELDS = ("predicted_compute_per_token_s", "measured_compute_per_token_s", "measured_page_cache_wait_per_token_s",
               "predicted_drive_reads_per_token", "measured_drive_reads_per_token", "at_harness_compute")
"""Cell fields an older record may lack (its relayout did not measure them)."""
RECORD_FIELDS = ("calibration_sharing", "calibration_merge")


def present_form(record: dict) -> dict:
    """``record`` in the present record form: fields an older version lacks are None (not measured)."""
    r = copy.deepcopy(record)
    for key in RECORD_FIELDS:
        r.setdefault(key, None)
    for c in r["cells"]:
        for key in CELL_FIELDS:
            c.setdefault(key, None)
    for x in r["comparisons"] + r["prefetch_comparisons"]:
        for key in DIAGNOSES:
            x.setdefault(key, None)
    r["version"] = VALIDATION_VERSION
    return r


def expected_of(path: Path) -> dict:
    """What the present rules make of one kept record: its judgements and summary."""
    record = json.loads(path.read_text())
    judged = judge_record(present_form(record), str(path))

    def where(x: dict) -> str:
        return f"{x['layout']} ram {x['ram_fraction']:g} prefetch {x['prefetch']}"

    return json.loads(json.dumps({
        "record": path.name, "recorded_version": record["version"], "recorded_verdict": record["summary"]["verdict"],
        "cells": {where(c): c["agreement"] for c in judged["cells"]},
        "comparisons": {where(x): x["agreement"] for x in judged["comparisons"]},
        "prefetch_comparisons": {where(x): x["agreement"] for x in judged["prefetch_comparisons"]},
        "summary": judged["summary"],
    }))


def check_profiles(validations: list[dict]) -> list[str]:
    """Each kept profile loads, and is the one a kept run used, drive and host bandwidth alike."""
    problems = []
    for path in sorted(RECORDS.glob("*.device.json")):
        profile = load_device(str(path))
        users = [r for r in validations if r["device"]["digest"] == profile.digest()]
        if not users:
            problems.append(f"{path.name}: no kept run used this profile")
        for r in users:
            used = r["device"]["profile"]
            if used["drive"] != json.loads(path.read_text())["drive"] or used["host_bandwidth"] != profile.host_bandwidth:
                problems.append(f"{path.name}: a kept run used another drive under this digest")
    return problems


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regenerate", action="store_true", help="write the expected files from the present rules")
    ap.add_argument("--show", nargs="+", metavar="RECORD", help="print these records' tables and summary, judged again")
    args = ap.parse_args(argv)
    if args.show:
        for path in args.show:
            record = json.loads(Path(path).read_text())
            judged = judge_record(present_form(record), path)
            print(f"== {path} (version {record['version']}): the record said {record['summary']['verdict']!r}, the "
                  f"present rules say {judged['summary']['verdict']!r}\n")
            print(format_validation(judged))
            print()
        return 0
    paths = sorted(RECORDS.glob("*.validation.json"))
    EXPECTED.mkdir(exist_ok=True)
    failed = 0
    for path in paths:
        got = expected_of(path)
        target = EXPECTED / path.name.replace(".validation.json", ".json")
        if args.regenerate:
            target.write_text(json.dumps(got, indent=1) + "\n")
            state = "written"
        elif not target.is_file():
            state, failed = "MISSING expected file", failed + 1
        else:
            want = json.loads(target.read_text())
            differs = [k for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
            differs += [f"summary.{k}" for k in sorted(set(want.get("summary", {})) | set(got["summary"]))
                        if "summary" in differs and want["summary"].get(k) != got["summary"].get(k)]
            state = "as expected" if not differs else "DIFFERS: " + ", ".join(differs)
            failed += bool(differs)
        s = got["summary"]
        print(f"{path.name:34} v{got['recorded_version']:<3} {s['verdict']:14} inside {s['inside_measured']:>2}/"
              f"{s['comparisons']:<2} cells {s['ratio_min']:.2f}-{s['ratio_max']:.2f}  {state}")
    problems = [] if args.regenerate else check_profiles([json.loads(p.read_text()) for p in paths])
    for p in problems:
        print("profile: " + p)
    print(f"{len(paths)} kept runs judged again, {failed} differ from their expected files; "
          f"{len(list(RECORDS.glob('*.device.json')))} kept profiles, {len(problems)} problems")
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
