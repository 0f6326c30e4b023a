"""The engine model and everything judged with it, in rooms by concept.

- :mod:`replay.formats`: the files the model reads and writes (trace, plan, gate record, pins).
- :mod:`replay.model`: the compiled model of the runtime's read path (numba).
- :mod:`replay.colibri`: the real engine's configuration, output and measured metrics.
- :mod:`replay.physical`: the harness that reads real drives, and calibration.
- :mod:`replay.evaluation`: statistics, evidence, the gate, hypotheses.
- :mod:`replay.control`: placement, split curves and policy experiments.
- :mod:`replay.execution`: running replays serially or on a Dask cluster.

The compiled model is cached on disk, in a directory named by its sources, and a build of it
ships with the package (:mod:`replay.compiled`).
"""

from replay.compiled import use_compiled_cache

use_compiled_cache()
