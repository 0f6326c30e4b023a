"""Kept calibrations refitted by the present queue model, beside the fit they were written with.

Usage: python benchmarks/refit_calibrations.py [DEVICE_JSON ...]

Default: every profile with calibration cells in ``benchmarks/records`` and its ``calibrations``
directory. Per profile: the fit it carries (a, RMS and worst |log(fitted / measured)| over its
cells) and the present :func:`replay.physical.calibrate.fit_queue_model` on the same cells (a, c, B, Q,
RMS, worst). This is how docs/BENCHMARKS.md ("Request channel time") compared the fit without
and with the request channel time ``c``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from replay.physical.calibrate import fit_queue_model

RECORDS = Path(__file__).resolve().parent / "records"


def main(paths: list[str]) -> int:
    files = [Path(p) for p in paths] or sorted([*RECORDS.glob("*.device.json"), *RECORDS.glob("calibrations/*.device.json")])
    us = 1e6
    for path in files:
        profile = json.loads(path.read_text())
        cal = profile.get("calibration", {})
        if not cal.get("cells"):
            continue
        cells, old, drive = cal["cells"], cal["fit"], profile["drive"]
        fit = fit_queue_model([c["size"] for c in cells], [c["depth"] for c in cells], [c["throughput_Bps"] for c in cells],
                              drive.get("max_request_bytes") or 0, shared=drive.get("service") == "shared")
        print(f"{path.name}: carried a {old['request_seconds'] * us:.1f} us, RMS {old['rms_log_error']:.3f}, worst "
              f"{old['max_abs_log_error']:.2f} | refitted a {fit['request_seconds'] * us:.1f} us, c "
              f"{fit['request_channel_seconds'] * us:.1f} us, B {fit['bandwidth'] / 1e9:.2f} GB/s, Q {fit['queue_slots']}, "
              f"RMS {fit['rms_log_error']:.3f}, worst {fit['max_abs_log_error']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
