"""The colibrì engine's own S per read path and cache cap, from runs kept by ``relayout measure --engine``.

Usage: ``python benchmarks/engine_read_paths.py RUNS_DIR`` where RUNS_DIR holds one directory per
cell (``<read path>-cap<N>``), each with the measured arm's run directories. Prints a Markdown table:
S (the engine's expert wait per committed token) with its 95% interval over runs, TPOT, read
service, expert matmul, hit rate and loads per committed token, and the machine's mean 1-minute
load average at the runs' starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replay.colibri.engine_metrics import engine_report  # noqa: E402


def main(runs_dir: str) -> None:
    cells = sorted(p for p in Path(runs_dir).iterdir() if p.is_dir())
    print("| cell | runs | S ms/token [95% CI over runs] | TPOT ms | read service ms/token | expert matmul ms/token "
          "| hit rate | loads/token | load avg |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cell in cells:
        arms = [a for a in sorted(cell.iterdir()) if a.is_dir()]
        for a in engine_report(arms)["arms"]:
            iv = a["stall_per_committed_token_ms_interval"]
            print(f"| {cell.name}{'' if len(arms) == 1 else ' ' + a['arm']} | {a['runs']} | "
                  f"{a['stall_per_committed_token_ms']:.2f} [{iv['low']:.2f}, {iv['high']:.2f}] | {a['tpot_ms']:.1f} | "
                  f"{a['service_ms_per_token']:.2f} | {a['matmul_ms_per_token']:.1f} | {a['hit_rate']:.3f} | "
                  f"{a['loads_per_token']:.1f} | {a['load_average']:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1])
