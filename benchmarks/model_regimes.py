"""The replay model's predictions in the regimes it is meant for, on the shipped profiles.

GLM-5.2 int4-row (19 MB experts), stock layout and a Louvain plan, a synthetic 120-token trace of
12 sessions, RAM 8 GB (colibrì's COALESCE measurement ran at ``--ram 8``): S in ms per committed
token at 1 and 8 workers, with and without coalescing, and the plan with coalescing under three
span caps. Prints two tables; no disk is touched.

    python benchmarks/model_regimes.py

To compare with an older model, run this file against that commit's tree:
``git worktree add /tmp/old REV && RELAYOUT_TREE=/tmp/old python benchmarks/model_regimes.py --stock-only``
(``--stock-only`` skips the plan, whose API may differ at old commits).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.environ.get("RELAYOUT_TREE", str(Path(__file__).resolve().parent.parent)))

import numpy as np  # noqa: E402

from containers.geometry import load_geometry  # noqa: E402
from relayout.planning.plan import make_plan, source_from_geometry  # noqa: E402
from relayout.traces.synth import SynthParams, synth_trace  # noqa: E402
from replay.model.config import RuntimeConfig  # noqa: E402
from replay.model.device import load_device  # noqa: E402
from replay.evaluation.gate import evaluation_forwards, run_layout  # noqa: E402
from replay.formats.planfile import load_plan, save_plan  # noqa: E402

PROFILES = ("mac-pro-2019-applraid-4x", "linux-md-raid0-4x", "single-nvme")
RAM = 8 * 10**9
CAPS_MB = (256, 58, 39)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stock-only", action="store_true", help="only the stock layout's table")
    args = ap.parse_args()
    g = load_geometry("glm-5.2-int4-row")
    trace = synth_trace(g.moe_layers, 256, 8, 120, 12, seed=3, params=SynthParams(clique_strength=0.9))
    source = source_from_geometry(g)
    pins = np.zeros((len(source.stock.layers), source.stock.n_experts), dtype=bool)
    every = np.ones(trace.n_forwards, dtype=bool)

    def S(layout, mask, **kw) -> float:
        return run_layout("x", trace, mask, layout, load_device(kw.pop("profile")), RuntimeConfig(ram_bytes=RAM, **kw),
                          pins).summary.stall_per_token_s * 1e3

    print("stock layout, every forward, RAM 8 GB: S ms/token")
    print(f"{'profile':<26}{'1 worker':>10}{'+coalesce':>11}{'8 workers':>11}{'+coalesce':>11}")
    for p in PROFILES:
        row = [S(source.stock, every, profile=p, workers=w, coalesce=c) for w in (1, 8) for c in (False, True)]
        print(f"{p:<26}" + "".join(f"{x:>11.1f}" for x in row))
    if args.stock_only:
        return
    with tempfile.TemporaryDirectory() as d:
        save_plan(make_plan(trace, source, progress=False), Path(d) / "plan.json")
        plan = load_plan(Path(d) / "plan.json")
    held, _ = evaluation_forwards(trace, [plan])
    print("\nheld-out forwards, 8 workers, RAM 8 GB: S ms/token, stock and the Louvain plan, coalescing by span cap")
    print(f"{'profile':<26}{'stock':>9}{'plan':>9}" + "".join(f"{f'cap {c} MB':>22}" for c in CAPS_MB))
    for p in PROFILES:
        cells = [S(source.stock, held, profile=p, workers=8), S(plan.layout, held, profile=p, workers=8)]
        for cap in CAPS_MB:
            kw = dict(profile=p, workers=8, coalesce=True, coalesce_max_bytes=cap * 10**6)
            cells.append(f"{S(source.stock, held, **kw):.1f} / {S(plan.layout, held, **kw):.1f}")
        print(f"{p:<26}{cells[0]:>9.1f}{cells[1]:>9.1f}" + "".join(f"{c:>22}" for c in cells[2:]))


if __name__ == "__main__":
    main()
