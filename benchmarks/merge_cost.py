"""What merging two reads into one saves on this disk, measured beside what the profile predicts.

Usage: python benchmarks/merge_cost.py FILE DEVICE_JSON [--sizes BYTES,...] [--gaps US,...] [--reps N]

FILE is a file of at least 64 MiB on the disk under test (read only, O_DIRECT); DEVICE_JSON is a
profile ``relayout calibrate`` wrote for that disk. For each size ``s`` (default 2 MiB, whose
merged read of 4 MiB is one request where the system's limit ``m`` is 4 MiB, and a Qwen3-30B-A3B
expert's 2,371,584 bytes, whose merged read the same system splits in two), each repetition takes,
in random order at random 4 KiB-aligned offsets: one read of ``s`` bytes; two reads of ``s``
bytes one straight after the other, as one loader thread issues a layer's experts; one read of
``2 s`` bytes (the two merged); and, for each ``--gaps`` value ``g`` (us), two reads of ``s``
bytes with the second issued ``g`` after the first completed (the thread busy meanwhile, as a
loader doing other work; the gap is not counted in the pair's time): the calibration's own
measurement (:func:`replay.physical.calibrate.merge_timings`), reads landing in huge-page buffers as the
harness's do.

Printed per size: the medians (us), the saving of the merged read against the pair (median of the
paired differences, with a 95% bootstrap interval) and against two lone reads, and what the profile
predicts it saves (:func:`replay.model.device.read_alone_seconds`: ``a``, plus up to ``c`` for each
request the merge removes), beside one lone read's ``a + c`` (what a model that charged every read a whole
small read's latency would predict). docs/BENCHMARKS.md ("Request channel time") records runs.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from replay.physical.calibrate import median_interval, merge_timings
from replay.model.device import load_device, read_alone_seconds

QWEN3_EXPERT_BYTES = 2_371_584


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("device")
    ap.add_argument("--sizes", default=f"{2 << 20},{QWEN3_EXPERT_BYTES}")
    ap.add_argument("--gaps", default="", help="us between the two reads of a pair, comma-separated (e.g. 10,20,40,80)")
    ap.add_argument("--reps", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    gaps = [float(g) for g in args.gaps.split(",") if g]
    drive = load_device(args.device).drive
    us = 1e6
    print(f"profile {args.device}: a {drive.request_seconds * us:.1f} us, c {drive.request_channel_seconds * us:.1f} us, "
          f"B {drive.bandwidth / 1e9:.2f} GB/s, m {drive.max_request // 1024} KiB, {drive.service}")
    for size in (int(s) for s in args.sizes.split(",")):
        t = merge_timings(args.file, size, args.reps, lone=True, gaps_us=gaps, seed=args.seed)
        size = t["size"]
        vs_pair = median_interval(t["pair"] - t["merged"], args.seed)
        vs_two = median_interval(2 * t["one"] - t["merged"], args.seed)
        predicted = 2 * read_alone_seconds(drive, size) - read_alone_seconds(drive, 2 * size)
        lone_read_cost = drive.request_seconds + drive.request_channel_seconds
        print(f"{size:>10} B x2: one {np.median(t['one']) * us:7.1f} us, pair {np.median(t['pair']) * us:7.1f}, "
              f"merged {np.median(t['merged']) * us:7.1f}; merging saves {vs_pair[0] * us:5.1f} us "
              f"[{vs_pair[1] * us:.1f}, {vs_pair[2] * us:.1f}] against the pair, {vs_two[0] * us:5.1f} "
              f"[{vs_two[1] * us:.1f}, {vs_two[2] * us:.1f}] against two lone reads; the profile predicts "
              f"{predicted * us:5.1f} us (one lone read's a + c: {lone_read_cost * us:5.1f} us)")
        for g in gaps:
            d = median_interval(t[("gap", g)] - t["merged"], args.seed)
            print(f"{'':>13}second read {g:g} us after the first: merging saves {d[0] * us:5.1f} us "
                  f"[{d[1] * us:.1f}, {d[2] * us:.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
