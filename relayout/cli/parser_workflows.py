"""The workflow commands' arguments: ``validate`` and ``demo``; their functions are in
:mod:`relayout.cli.commands_workflows`.
"""

from __future__ import annotations

from containers.jsonfile import shipped_names
from replay.model.config import PREFETCH_SOURCES

import relayout.cli.commands_workflows as commands
from relayout.workflows.validation.engine import EngineValidateOptions as Engine
from relayout.workflows.validation.options import ValidateOptions as Emulation

from . import options as opt
from .arguments import command


def add_validate(sub) -> None:
    """``validate``: the disk, the model measured, the cells and the record."""
    s = command(sub, "validate", "measure S for real on the disk holding PATH and compare it with the replay model's "
                                 "prediction, cell by cell: the model holds, does not hold, or the measurement is "
                                 "inconclusive (insufficient below 4 repetitions per cell)", commands.cmd_validate)
    s.add_argument("path", help="a directory on the disk to validate (calibration file and work directory go there)")
    s.add_argument("--device", metavar="PROFILE.json",
                   help=f"use this profile ({', '.join(shipped_names('devices'))} or a JSON) instead of calibrating PATH")
    s.add_argument("--container", metavar="DIR", help="measure this container (on the disk under test; only read) instead "
                                                      "of a synthetic one; each non-stock layout is a full copy under PATH")
    s.add_argument("--gb", type=opt.positive_gigabytes, help="size of the synthetic container (GLM-5.2 int4-row, 18.9 MB "
                                                         f"experts), GB (default: {Emulation.gb:g})")
    s.add_argument("--minutes", type=opt.number(0.0, 1e5, lo_open=True), help="fit the whole run in about this many minutes: a probe measurement "
                                                 "chooses --reps (>= 2) and/or --tokens")
    s.add_argument("--tokens", type=opt.count, help="held-out steps measured and replayed per run (default 40)")
    s.add_argument("--reps", type=opt.count, help="measured repetitions per cell, >= 2 (default 4; an even count "
                                            f"counterbalances the run order; with --engine {Engine.reps})")
    s.add_argument("--layouts", default="stock,louvain,random", help="layouts to measure; stock is the baseline")
    s.add_argument("--ram", help="RAM budgets for the expert LRU, fractions of the routed bytes (default: "
                                 f"{','.join(f'{x:g}' for x in Emulation.ram)})")
    s.add_argument("--prefetch", help=f"prefetch sources ({', '.join(PREFETCH_SOURCES)}); with none among them each "
                                      f"source's saving against none is judged too (default: {','.join(Emulation.prefetch)})")
    s.add_argument("--workers", type=opt.count, help=f"reader workers, 1-16 (default: {Emulation.workers})")
    s.add_argument("--coalesce", action="store_true", help="coalesce adjacent experts' reads (colibrì's COALESCE), "
                                                         "measured and modelled alike: where the order of experts matters")
    s.add_argument("--seed", type=opt.seed, default=0, help="seed of the synthetic container, trace and plans")
    s.add_argument("-o", "--output", help="the record to write (a calibrated profile is saved next to it as "
                                          "NAME.device.json) (default: validation.json; with --engine "
                                          "PATH/validation-engine.json)")
    s.add_argument("--plots", metavar="DIR", help="write a predicted vs measured S scatter (needs the 'plots' extra: matplotlib)")
    s.add_argument("--keep", action="store_true", help="keep the work directory (PATH/relayout-validate: containers, "
                                                      "plans, STALL_TRACEs)")
    e = s.add_argument_group("against the real colibrì engine (validate --engine; PATH is then the validation's own "
                             "directory, resumable: runs, plans, rewritten containers and the record are kept there)")
    e.add_argument("--engine", metavar="BINARY", help="the colibrì binary: measure its S per layout and cell and judge the "
                                                     "model's prediction of each run (needs --container, --prompts, "
                                                     "--train-prompts)")
    e.add_argument("--prompts", metavar="FILE", help="the measured prompts, one per line (held out: none may be a "
                                                    "training prompt)")
    e.add_argument("--train-prompts", metavar="FILE", help="prompts whose routing trains the plans, one per line")
    e.add_argument("--read-paths", help="the engine's read paths measured, ';'-separated, each in its own variables "
                                        f"(default: {';'.join(Engine.read_paths)})")
    e.add_argument("--caps", help="experts per layer the engine's LRU holds (CAP, with CAP_RAISE=0 AUTOPIN=0), one cell "
                                  f"each (default: {','.join(map(str, Engine.caps))})")
    e.add_argument("--ngen", type=opt.count, help=f"tokens generated per run (NGEN) (default: {Engine.ngen})")
    e.add_argument("--engine-env", metavar="'NAME=value ...'",
                   help="more engine variables for every run, e.g. 'COLI_NO_OMP_TUNE=1'")
    e.add_argument("--timeout", type=opt.number(0.0, 1e6, lo_open=True), help="kill a run after this many seconds")


def add_demo(sub) -> None:
    """``demo``."""
    s = command(sub, "demo", "run the pipeline end to end on a small synthetic model", commands.cmd_demo)
    s.add_argument("--dir", help="where the demo keeps its files: a new or empty directory, or a previous demo's "
                                 "(default: a new folder relayout-demo[-N] under the current directory)")
    s.add_argument("--seed", type=opt.seed, default=0, help="seed of the model, trace and plan")
