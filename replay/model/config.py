"""The runtime's configuration: its knobs, and how a RAM budget becomes pin sets and LRU capacities.

Pure Python and numpy (no compiled code), so the command line can build its options and
planning can rank pins without loading the replay model. Bytes, seconds, bytes/s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from containers.errors import InputError

PREFETCH_SOURCES = ("none", "oracle", "coupled")
"""Prefetch sources the runtime (and so the measuring harness, :mod:`replay.physical.measure`) has (see
:mod:`replay.model.prefetch`)."""

ENGINE_SOURCES = PREFETCH_SOURCES + ("pilot",)
"""Prefetch sources colibrì has: the harness's, and its router pilot (``PILOT_REAL``), whose
predictions no routing trace records: the model draws them at the precision the engine measured
(``RuntimeConfig.pilot_precision``, :func:`replay.model.prefetch.predict_next`); the harness does not run it."""

FUSABLE_SOURCES = ("coupled", "heat", "persistence", "session")
"""The probability sources several of which one run may fuse (:mod:`replay.model.predictors`)."""

MODEL_SOURCES = ENGINE_SOURCES + ("heat", "persistence", "session")
"""Prefetch sources the replay model has: colibrì's, and the probability sources of
:mod:`replay.model.predictors` (replay only). The compiled model takes a source as its index here."""

SOURCE_SEPARATOR = "+"
"""Joins several prefetch sources run at once (``"coupled+persistence"``): their probabilities
are fused into one (:mod:`replay.model.predictors`), each candidate credited to one of them
(:mod:`replay.model.admission`)."""

MAX_SOURCES = 3
"""Most sources one run combines (the fusion is learned over every combination of their
calibration bins: ``CALIBRATION_BINS ** MAX_SOURCES`` cells per layer)."""

FUSED = len(MODEL_SOURCES)
"""The compiled model's source index of several sources at once (the fused probability)."""

ADMISSION_POLICIES = ("top-k", "probability", "per-byte", "deadline", "stall-value", "oracle", "observe")
"""How the prefetcher admits a source's candidates (:mod:`replay.model.admission`): ``top-k`` (the
runtime's rule: the source's K best, in rank order), ``probability`` (highest probability first),
``per-byte`` (probability per byte), ``deadline`` (earliest estimated need first), ``stall-value``
(the expected stall a load saves, V(a), per byte), ``oracle`` (the experts really needed, in need order: a bound, not deployable),
``observe`` (load nothing; score the late-need probability q). The compiled model takes a policy
as its index here."""


@dataclass(frozen=True)
class RuntimeConfig:
    """Runtime knobs and the compute model. Bytes, seconds, bytes/s."""

    ram_bytes: int = 0                 # LRU budget for whole experts (0 = no cache)
    workers: int = 8                   # reader workers (PIPE_WORKERS), 1-16
    batched: bool = False              # io_uring-style queue: up to 64 loads in flight
    coalesce: bool = False             # one read for experts contiguous in one file
    coalesce_max_bytes: int = 256 * 1024 * 1024
    coalesce_gap_bytes: int = 64 * 1024
    direct: bool = True                # O_DIRECT weight reads (scales are always buffered)
    pin_bytes: int = 0                 # hottest experts pinned in RAM (by training heat)
    dense_seconds: float = 1.0e-3      # per layer and forward, before routing: attention, router
    compute_bytes_per_second: float = 50e9  # an expert's matmul streams its weights at this rate, per position
    other_seconds_per_token: float = 0.0    # O in TPOT = C + S + O
    prefetch: str = "none"             # prefetch source for the next layer (MODEL_SOURCES; the runtime has PREFETCH_SOURCES)
    prefetch_experts: int = 6          # K: experts predicted per layer (colibrì PILOT_K); Q, the queue-slot budget, for other policies
    admission: str = "top-k"           # prefetch admission policy (ADMISSION_POLICIES)
    prefetch_bytes: int = 0            # B: speculative bytes admitted per layer (0 = only Q limits)
    prefetch_candidates: int = 16      # the source's most probable experts a policy chooses among, 1-64
    prefetch_min_probability: float = 0.02  # candidates below this probability are not considered
    cancel_stale: bool = False         # stop a load's later reads once the next layer is routed without it
    adaptive_budget: bool = False      # admit only the bytes the drives can deliver before the next layer is routed
    backoff: bool = False              # a layer stops prefetching while its measured stall-conversion turns non-positive
    source_caps: list[float] = field(default_factory=list)  # per source of `prefetch`, in order: the most of B and of Q it takes per layer (share, 0-1); [] = no caps
    blocking: bool = False             # colibrì PIPE=0: a layer's misses load as one batch on `workers` threads (the OpenMP team), the compute thread blocked until all are in
    routing_order: bool = False        # misses issued, waited for and promoted into the LRU in routing order, hits computed between them in that order (colibrì's moe()); False: physical order, resident matmuls first
    page_cache_bytes: int = 0          # the page cache for the experts' pages, weights and scales (replay.model.pagecache), bytes; 0: every buffered weight read reaches the drive
    cpu_cores: int = 0                 # the machine's cores: at most this many page-cache copies run at once (replay.model.readers); 0 = not bounded
    team_held_cores: int = 0           # cores the OpenMP team keeps from page-cache copies (replay.model.demand): 0 = copies use every core, beside the matmuls
    loaders_on_compute_core: bool = False  # colibrì PIPE=1 under its bound team: the loader pool is parked on the compute thread's core, so each block of demand loads waits the pool's handoff first (the device profile's loader_handoff)
    mapped_views: bool = False         # colibrì COLI_MMAP=1: experts are views of the page cache; a page-cache hit re-touches mapped pages (at the copy rates the caller gives, the rate a run of it measured)
    pilot_precision: float = 0.0       # prefetch "pilot": the share of the router pilot's predictions the next layer routes (colibrì's LOOKA line), 0-1
    pilot_workers: int = 1             # prefetch "pilot": the threads loading its queue, in queue order (colibrì PILOT_WORKERS under PILOT_REAL), 1-16
    couple_file: str = ""               # prefetch "pilot" with colibrì COUPLE: the .coli_pairs file whose table's loads join the pilot's ("" none)
    couple_experts: int = 0            # COUPLE_K: the table's best experts queued per position after the pilot's (0: no COUPLE)
    evict_guard: bool = False          # colibrì PILOT_EVICT_GUARD: a prefetch load may evict a warm expert only when its own heat is clearly higher (replay.model.runtime.guard_protects)
    prefetch_hints: bool = False       # colibrì PILOT=1 or COUPLE without PILOT_REAL: the prefetch thread's loads are page-cache hints (WILLNEED): drive reads into the page cache, no copy, not into the LRU
    layer_barrier: bool = False        # colibrì PILOT_REAL: a layer waits, whole, for the prefetch load in flight on it; the wait is other time, not stall; every started load enters the LRU
    copy_threads: int = 0              # threads that copy page-cache hits, when fewer than the readers (URING=1's one io-wq worker): 0 = every reader copies its own
    lru_experts: int = -1              # experts each layer's LRU holds (colibrì's resolved cap); -1: ram_bytes shared evenly by the layers
    engine_env: str = ""               # the colibrì run configuration this models, in its own variables (replay.colibri.engine_config); "" = relayout's own read path
    runtime_changes: list[str] = field(default_factory=list)  # what of this configuration the public colibrì does not run (RUNTIME_CHANGES), set from the fields

    def __post_init__(self):
        limit = MAX_TEAM if self.blocking else 16
        if not self.batched and not 1 <= self.workers <= limit:
            raise InputError(None, f"--workers must be 1-{limit} (got {self.workers})")
        if self.page_cache_bytes < 0:
            raise InputError(None, f"the page cache for experts must be >= 0 bytes (got {self.page_cache_bytes})")
        if isinstance(self.cpu_cores, bool) or not isinstance(self.cpu_cores, int) or not 0 <= self.cpu_cores <= MAX_TEAM:
            raise InputError(None, f"the machine's cores must be a whole number of 0-{MAX_TEAM} (got {self.cpu_cores!r})")
        if (isinstance(self.team_held_cores, bool) or not isinstance(self.team_held_cores, int)
                or not 0 <= self.team_held_cores < max(self.cpu_cores, 1)):
            raise InputError(None, f"the cores the OpenMP team keeps from copies must be a whole number below the "
                                   f"machine's {self.cpu_cores} cores (got {self.team_held_cores!r})")
        if isinstance(self.copy_threads, bool) or not isinstance(self.copy_threads, int) or not 0 <= self.copy_threads <= MAX_TEAM:
            raise InputError(None, f"the copying threads must be a whole number of 0-{MAX_TEAM} (got {self.copy_threads!r})")
        if self.lru_experts < -1:
            raise InputError(None, f"the LRU's experts per layer must be >= 0 (got {self.lru_experts})")
        object.__setattr__(self, "runtime_changes", runtime_changes(self))
        if self.ram_bytes < 0 or self.pin_bytes < 0:
            raise InputError(None, "RAM budgets must be >= 0")
        if self.coalesce_max_bytes < 1 or self.coalesce_gap_bytes < 0:
            raise InputError(None, "coalescing needs a span of at least 1 byte and a gap >= 0")
        names = prefetch_sources(self.prefetch)
        object.__setattr__(self, "source_caps", [float(c) for c in self.source_caps])
        if self.source_caps:
            if len(self.source_caps) != len(names) or self.prefetch == "none":
                raise InputError(None, f"--source-caps gives {len(self.source_caps)} shares for the prefetch source(s) "
                                       f"{self.prefetch!r}: give one per source, in order")
            if not all(0.0 <= c <= 1.0 for c in self.source_caps):
                raise InputError(None, f"--source-caps: every share must be in [0, 1] (got {list(self.source_caps)})")
            if self.admission == "observe":
                raise InputError(None, "per-source caps share the prefetch budgets; admission 'observe' loads nothing")
        if self.prefetch == "pilot" and not (0.0 < self.pilot_precision <= 1.0 and self.admission == "top-k"):
            raise InputError(None, "the pilot prefetch source takes the router pilot's measured precision (0 < p <= 1; "
                                   "colibrì prints it with LOOKA=1) and the runtime's top-k rule "
                                   f"(got precision {self.pilot_precision!r}, admission {self.admission!r})")
        if (isinstance(self.pilot_workers, bool) or not isinstance(self.pilot_workers, int)
                or not 1 <= self.pilot_workers <= 16):
            raise InputError(None, f"the pilot's loading threads must be a whole number of 1-16 (got {self.pilot_workers!r})")
        if self.pilot_workers > 1 and not (self.prefetch == "pilot" and self.layer_barrier and not self.batched):
            raise InputError(None, "several threads load the router pilot's queue only under PILOT_REAL (prefetch "
                                   "'pilot' with the layer barrier) and not batched, as colibrì runs PILOT_WORKERS (got "
                                   f"{self.pilot_workers} threads, prefetch {self.prefetch!r}, layer barrier "
                                   f"{self.layer_barrier}, batched {self.batched})")
        if self.couple_experts and not (self.prefetch == "pilot" and self.couple_file and self.couple_experts <= 32):
            raise InputError(None, "COUPLE's table joins the router pilot's loads (prefetch 'pilot'): give its file and "
                                   f"COUPLE_K 1-32 (got {self.couple_file!r}, {self.couple_experts})")
        if self.couple_file and self.prefetch not in ("pilot", "coupled"):
            raise InputError(None, f"a COUPLE file ({self.couple_file}) is read by the pilot or coupled prefetch source, "
                                   f"not {self.prefetch!r}")
        if (self.prefetch_hints or self.layer_barrier) and self.prefetch not in ("pilot", "coupled"):
            raise InputError(None, "page-cache hints and the layer barrier are colibrì's prefetch thread's: prefetch "
                                   f"'pilot' or 'coupled' (got {self.prefetch!r})")
        if self.prefetch_hints and (self.layer_barrier or self.evict_guard):
            raise InputError(None, "page-cache hints take no LRU slot: no eviction guard, no layer barrier")
        if not 1 <= self.prefetch_experts <= 64:
            raise InputError(None, f"--prefetch-experts must be 1-64 (got {self.prefetch_experts})")
        if self.admission not in ADMISSION_POLICIES:
            raise InputError(None, f"unknown admission policy {self.admission!r} (choose {', '.join(ADMISSION_POLICIES)})")
        if self.prefetch_bytes < 0 or not 1 <= self.prefetch_candidates <= 64:
            raise InputError(None, "prefetch budgets: bytes must be >= 0 and candidates 1-64")
        if not 0.0 <= self.prefetch_min_probability <= 1.0:
            raise InputError(None, f"--prefetch-min-probability must be in [0, 1] (got {self.prefetch_min_probability})")
        if self.compute_bytes_per_second <= 0 or self.dense_seconds < 0:
            raise InputError(None, "compute model needs a positive rate and non-negative dense time")

    @property
    def copy_cores(self) -> int:
        """Cores page-cache copies can run on at once: the machine's less those the OpenMP team
        keeps from them; 0 = copies not bounded."""
        return self.cpu_cores - self.team_held_cores if self.cpu_cores else 0

    @property
    def copy_slots(self) -> int:
        """Page-cache copies that run at once: the cores copies may use (:attr:`copy_cores`), at
        most ``copy_threads`` when given; 0 = copies not bounded."""
        return min(self.copy_cores, self.copy_threads) if self.copy_cores and self.copy_threads else self.copy_cores

    @property
    def in_flight(self) -> int:
        """Loads that can be outstanding at once."""
        return 64 if self.batched else self.workers

    @property
    def sources(self) -> tuple[str, ...]:
        """The prefetch source names of ``prefetch``, in order (``()`` for ``none``)."""
        return () if self.prefetch == "none" else prefetch_sources(self.prefetch)

    def to_json(self) -> dict:
        return asdict(self)


MAX_TEAM = 1024
"""Most threads a blocking batch (colibrì's PIPE=0 OpenMP team) is modelled with."""

RUNTIME_CHANGES = {
    "coalesce": "--coalesce: one pread for experts contiguous in one shard, a patched colibrì (pull request 1398 in "
                "JustVugg/colibri, not merged)",
    "admission": "--policy/admission other than top-k: prefetch admission colibrì does not have",
    "prefetch-controls": "prefetch byte budget, adaptive budget, per-source caps, stale cancellation or backoff: "
                         "controls colibrì's prefetcher does not have",
    "prefetch-source": "a prefetch source colibrì does not have (heat, persistence, session or fused sources)",
}
"""relayout-only read-path features: each needs a runtime change before colibrì runs it (the label
``RuntimeConfig.runtime_changes`` carries into output and gate.json)."""


REPLAY_ONLY_FIELDS = ("prefetch", "admission", "prefetch_bytes", "cancel_stale", "adaptive_budget", "backoff",
                      "source_caps")
"""The :class:`RuntimeConfig` fields the runtime has only at one setting (its prefetch sources
:data:`ENGINE_SOURCES`, ``top-k`` admission, no byte budget, stale cancellation, adaptive budget,
backoff or per-source caps); any other setting exists in the replay model only
(:func:`replay_only_settings`). Every other field is a knob the runtime, and so the measuring
harness, has too."""


def replay_only_settings(config: "RuntimeConfig") -> list[tuple[str, str]]:
    """``(field, the setting in words)`` of each :data:`REPLAY_ONLY_FIELDS` field ``config`` sets
    to what only the replay model performs, in that order (empty when the runtime has them all).

    >>> replay_only_settings(RuntimeConfig(prefetch="heat", backoff=True))
    [('prefetch', "prefetch source 'heat'"), ('backoff', 'backoff')]
    >>> replay_only_settings(RuntimeConfig(prefetch="coupled", coalesce=True))
    []
    """
    settings = {
        "prefetch": (config.prefetch not in ENGINE_SOURCES, f"prefetch source {config.prefetch!r}"),
        "admission": (config.admission != "top-k", f"admission policy {config.admission!r}"),
        "prefetch_bytes": (config.prefetch_bytes > 0, "a speculative-byte budget"),
        "cancel_stale": (config.cancel_stale, "stale cancellation"),
        "adaptive_budget": (config.adaptive_budget, "the adaptive budget"),
        "backoff": (config.backoff, "backoff"),
        "source_caps": (bool(config.source_caps), "per-source caps"),
    }
    return [(name, settings[name][1]) for name in REPLAY_ONLY_FIELDS if settings[name][0]]


def runtime_changes(config: "RuntimeConfig") -> list[str]:
    """The :data:`RUNTIME_CHANGES` labels of what ``config`` models that the public colibrì does not
    run: coalescing, and its :func:`replay_only_settings` grouped as source, admission and controls."""
    replay_only = {name for name, _ in replay_only_settings(config)}
    out = []
    if config.coalesce:
        out.append(RUNTIME_CHANGES["coalesce"])
    if "admission" in replay_only:
        out.append(RUNTIME_CHANGES["admission"])
    if replay_only - {"prefetch", "admission"}:
        out.append(RUNTIME_CHANGES["prefetch-controls"])
    if "prefetch" in replay_only:
        out.append(RUNTIME_CHANGES["prefetch-source"])
    return out


def prefetch_sources(prefetch: str) -> tuple[str, ...]:
    """The source names of a ``prefetch`` setting: one of :data:`MODEL_SOURCES`, or 2 to
    :data:`MAX_SOURCES` distinct probability sources joined by :data:`SOURCE_SEPARATOR` (not
    ``none``, ``oracle`` or ``pilot``: :data:`FUSABLE_SOURCES`)."""
    if prefetch in MODEL_SOURCES:
        return (prefetch,)
    names = tuple(prefetch.split(SOURCE_SEPARATOR))
    if len(names) < 2 or any(n not in MODEL_SOURCES for n in names):
        raise InputError(None, f"unknown prefetch source {prefetch!r} (choose {', '.join(MODEL_SOURCES)}, or several of "
                               f"{', '.join(FUSABLE_SOURCES)} joined by {SOURCE_SEPARATOR!r})")
    if set(names) - set(FUSABLE_SOURCES) or len(set(names)) != len(names) or len(names) > MAX_SOURCES:
        raise InputError(None, f"prefetch sources {prefetch!r}: combine 2-{MAX_SOURCES} distinct sources of "
                               f"{', '.join(FUSABLE_SOURCES)} (not none, oracle or pilot)")
    return names


def source_index(prefetch: str) -> int:
    """The compiled model's index of a ``prefetch`` setting: its place in :data:`MODEL_SOURCES`,
    or :data:`FUSED` for several sources."""
    names = prefetch_sources(prefetch)
    return MODEL_SOURCES.index(names[0]) if len(names) == 1 else FUSED


def lru_capacities(ram_bytes: int, expert_bytes: np.ndarray, lru_experts: int = -1) -> np.ndarray:
    """Experts each layer's LRU holds: ``lru_experts`` in every layer when >= 0 (colibrì's cap),
    else as many as ``ram_bytes`` shared evenly by the layers pays for."""
    L = len(expert_bytes)
    if lru_experts >= 0:
        return np.full(L, lru_experts, dtype=np.int64)
    if ram_bytes <= 0:
        return np.zeros(L, dtype=np.int64)
    return (ram_bytes // L // np.maximum(expert_bytes, 1)).astype(np.int64)


def greedy_by_value(value: np.ndarray, cost: np.ndarray, budget: float) -> np.ndarray:
    """Boolean [L, E]: items taken best value first (ties by layer, then id) while they fit.

    ``value`` [L, E] is value per byte; ``cost`` [L] bytes per item of a layer. Items of value
    <= 0 are never taken; an item that does not fit is skipped and smaller ones may still fit.
    """
    L, E = value.shape
    out = np.zeros((L, E), dtype=bool)
    order = np.lexsort((np.tile(np.arange(E), L), np.repeat(np.arange(L), E), -value.ravel()))
    used = 0.0
    for flat in order.tolist():
        li, e = divmod(flat, E)
        if value[li, e] <= 0:
            break
        if used + cost[li] > budget:
            continue
        used += cost[li]
        out[li, e] = True
    return out


def pinned_experts(heat: np.ndarray, expert_bytes: np.ndarray, pin_bytes: int) -> np.ndarray:
    """Boolean [L, E]: hottest experts (selections per byte) until ``pin_bytes`` is used."""
    if pin_bytes <= 0:
        return np.zeros(heat.shape, dtype=bool)
    return greedy_by_value(heat / np.maximum(expert_bytes, 1)[:, None], np.asarray(expert_bytes, dtype=np.float64), pin_bytes)
