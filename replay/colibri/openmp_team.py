"""colibrì's OpenMP team: how long its idle threads spin, whether it is bound to cores, and which
cores it keeps from the page-cache copies of the loaders and io-wq workers.

The rules are colibrì's hot-thread tuning (``main``: ``OMP_WAIT_POLICY=active``,
``GOMP_SPINCOUNT=200000``, ``OMP_PROC_BIND=close`` unless ``COLI_NO_OMP_TUNE`` is given) and
libgomp's reading of those variables; what they do to the copies was measured with
``benchmarks/engine_team.py`` (docs/ENGINE_MODEL.md, "Who copies, on which cores"). Pure Python;
a configuration is a :class:`replay.colibri.engine_config.EngineConfig`.
"""

from __future__ import annotations

import re

TUNED_SPIN_COUNT = "200000"
"""The ``GOMP_SPINCOUNT`` colibrì sets, with ``OMP_WAIT_POLICY=active``, unless the user set them or
``COLI_NO_OMP_TUNE`` is given (``main``'s hot-thread tuning, Linux CPU builds)."""

LIBGOMP_SPIN_COUNT = 300000.0
"""libgomp's spin iterations when neither ``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT`` is set."""

URING_COPY_THREADS = 1
"""io-wq threads that copy URING=1's page-cache hits: io-wq starts another worker only when one
blocks, and a read the page cache serves does not (docs/ENGINE_MODEL.md, "Who copies, on which
cores")."""

SPIN_COUNT_TEXT = re.compile(r"\s*([0-9]+\s*[kKmMgGtT]?|infinite|infinity)\s*\Z")
"""A ``GOMP_SPINCOUNT`` value as libgomp reads it: a count with an optional k, M, G or T, or infinite."""

SPIN_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
"""What each ``GOMP_SPINCOUNT`` suffix multiplies the count by."""

OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND", "OMP_PLACES")
"""The OpenMP variables a run's recorded environment gives the model (how the team waits, and where it runs)."""

INHERITED_TEAM_VARIABLES = OPENMP_VARIABLES + ("COLI_NO_OMP_TUNE", "OMP_NUM_THREADS")
"""Variables a run inherits from the shell that change how its OpenMP team runs: ``relayout measure
--engine`` records them with the run's own."""


def team_spin_iterations(cfg) -> float:
    """How many iterations libgomp's idle OpenMP threads spin after a parallel region before they
    sleep (``inf``: they never sleep), under ``cfg``.

    colibrì's hot-thread tuning (Linux, unless ``COLI_NO_OMP_TUNE`` is given) sets
    ``OMP_WAIT_POLICY=active`` and ``GOMP_SPINCOUNT=200000`` where the user did not. libgomp then
    takes ``GOMP_SPINCOUNT`` when set, else spins without end under ``ACTIVE``, not at all under
    ``PASSIVE``, and 300000 iterations when neither is set.

    References
    ----------
    colibrì ``main`` (the ``COLI_OMP_TUNED`` re-exec); libgomp ``env.c`` (``initialize_env``).
    """
    tuned = not cfg.COLI_NO_OMP_TUNE
    count = cfg.GOMP_SPINCOUNT or (TUNED_SPIN_COUNT if tuned else "")
    policy = cfg.OMP_WAIT_POLICY or ("ACTIVE" if tuned else "")
    if count:
        text = count.strip().lower()
        if text.startswith("infinit"):
            return float("inf")
        digits = text.rstrip("kmgt").strip()
        return float(digits) * SPIN_SUFFIX[text[len(text.rstrip("kmgt")):]]
    if policy == "ACTIVE":
        return float("inf")
    return 0.0 if policy == "PASSIVE" else LIBGOMP_SPIN_COUNT


def team_bound(cfg) -> bool:
    """Whether libgomp binds the OpenMP team's threads to places under ``cfg``: ``OMP_PROC_BIND``
    other than ``false``, or ``OMP_PLACES`` given, or neither given and colibrì's hot-thread tuning
    on (it sets ``OMP_PROC_BIND=close``). A bound process's main thread is bound from its start
    (libgomp's constructor), so every thread it starts later (PIPE=1's loaders, URING=1's io-wq
    workers) inherits that one core.

    References
    ----------
    colibrì ``main`` (the hot-thread tuning, and its note on the inherited affinity mask);
    libgomp ``env.c`` (``initialize_env``: ``OMP_PLACES`` implies binding).
    """
    if cfg.OMP_PROC_BIND:
        return cfg.OMP_PROC_BIND.split(",")[0] != "false"
    return bool(cfg.OMP_PLACES) or not cfg.COLI_NO_OMP_TUNE


def team_held_cores(cfg, team: int, cores: int) -> int:
    """Cores the OpenMP team (``team`` threads on ``cores`` cores) keeps from the page-cache copies
    of PIPE=1's loaders or URING=1's io-wq workers (:attr:`RuntimeConfig.team_held_cores`).

    - A bound team (:func:`team_bound`, colibrì's default): the loaders and io-wq workers inherit
      the main thread's one core, so they copy on that core only: ``cores - 1``.
    - URING=1, a team not bound whose idle threads spin between regions
      (:func:`team_spin_iterations` above 0, on a team no wider than the cores: libgomp spins only
      briefly otherwise): the spinners' ``team - 1`` cores. io-wq adds a worker only when one
      blocks, so the page-cache hits, which never block, are copied by one worker, which the
      spinning team leaves one core.
    - Otherwise 0: PIPE=1's loaders share every core with the team (measured no slower with the
      team spinning than parked: docs/BENCHMARKS.md), and a team that sleeps between regions
      leaves its cores to them.

    PIPE=0 loads on the team itself: 0.
    """
    if not cfg.PIPE:
        return 0
    if team_bound(cfg):
        return cores - 1
    if cfg.URING and team <= cores and team_spin_iterations(cfg) > 0:
        return min(team, cores) - 1
    return 0


HANDOFF_NOTE = ("has no loader handoff (it was made before relayout calibrate measured one): the wake-ups each "
                "block of PIPE=1 loads costs on the compute thread's core (about 40 us for 8 loaders on the machine of "
                "docs/BENCHMARKS.md) are not counted; run relayout calibrate again")
"""What ``replay`` and ``validate --engine`` say of a device profile without ``loader_handoff``."""


def loaders_on_compute_core(cfg) -> bool:
    """Whether PIPE=1's loader pool is parked on the compute thread's core
    (:attr:`RuntimeConfig.loaders_on_compute_core`): its pthreads, started by the compute thread
    after libgomp bound it (:func:`team_bound`), inherit its one core. Each block of demand loads
    then costs the pool's handoff there (:mod:`replay.physical.loader_handoff`). URING=1's io-wq
    workers are not that pool."""
    return bool(cfg.PIPE and not cfg.URING and team_bound(cfg))
