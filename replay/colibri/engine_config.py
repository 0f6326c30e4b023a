"""A colibrì run configuration in the engine's own variables, and the read policy the model takes from it.

colibrì reads its read-path configuration from environment variables (``PIPE=1 DIRECT=1
RAM_GB=128``); :func:`env_words` reads such a string with one set of rules (strict about
unknown variables for a configuration to model, tolerant of them for an environment to run the
engine with), :func:`parse_runtime_env` reads it into an :class:`EngineConfig`, and
:func:`config_from_run` reads the effective configuration a run printed (its ``[PROF] config``
line and the lines beside it). :func:`model_config` maps an :class:`EngineConfig` onto the
model's :class:`replay.model.config.RuntimeConfig`. What each variable does in the engine, with
references into its source, is docs/ENGINE_MODEL.md; the defaults here are the engine's on Linux.

Pure Python (no compiled code). Bytes, seconds, bytes/s; RAM_GB and PIN_GB in GB (1e9 bytes).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from containers.errors import InputError
from containers.jsonfile import parse_json, read_bytes

from replay.colibri.engine_output import RUN_FILE, RunIdentity, parse_engine_output
from replay.colibri.openmp_team import OPENMP_VARIABLES, SPIN_COUNT_TEXT, URING_COPY_THREADS, loaders_on_compute_core, team_held_cores
from replay.model.config import RuntimeConfig

FLAGS = ("PIPE", "URING", "DIRECT", "COLI_MMAP", "CAP_RAISE", "AUTOPIN", "PILOT", "PILOT_REAL", "PILOT_TWO",
         "PILOT_EVICT_GUARD", "COLI_PIPE_BLOCK")
"""Variables that are 0 or 1."""

NO_READ_EFFECT = ("SNAP", "COLI_MODEL", "PROMPT", "COLI_PROMPT", "NGEN", "PROF", "TOKENS", "ROUTE_TRACE",
                  "STATS", "SEED", "TEMP", "COLI_TEMP", "CTX", "REF", "SERVE", "LOOKA")
"""Variables a run's environment may carry that do not change how experts are read: accepted and ignored."""

PIPE_POOL_MAX = 16
"""colibrì's pthread loader pool holds at most this many workers (``pipe_init`` clamps PIPE_WORKERS)."""

URING_LOADS = 64
"""Loads one io_uring submission holds (colibrì's ``URING_LOAD_MAX``): the model's batched queue depth."""

SLACK_BYTES = 1.2e9 + 2.5e9
"""colibrì's fixed RAM reserve in ``cap_for_ram``: activations and overhead, and the page-cache reserve (bytes)."""

WORKING_SET_SLOTS = 64
"""Expert slabs of the per-block working set ``cap_for_ram`` reserves (``ws[64]``), each of the widest expert."""


@dataclass(frozen=True)
class EngineConfig:
    """colibrì's read-path variables, named and defaulted as the engine on Linux (CPU build).

    ``CAP`` is the requested experts per layer (argv[1] or the CAP variable; 0 = not given: 64 for a
    bare invocation). ``RAM_GB`` 0 = auto (0.88 x MemAvailable of the machine the engine runs on).
    ``PIN`` a pin file or ``auto`` ("" none), ``PIN_GB`` its budget (-1 = ``all``). ``COUPLE`` a
    coupling file ("" none). ``PILOT_K`` 0 = not given (6 under PILOT_REAL, else 8);
    ``PILOT_WORKERS`` the router pilot's loading threads, ``PILOT_EVICT_GUARD`` its eviction guard,
    ``PILOT_TWO`` its two-step prediction.
    ``OMP_NUM_THREADS`` 0 = not given (the OpenMP team is as wide as the machine's cores).
    ``OMP_WAIT_POLICY`` ``ACTIVE``, ``PASSIVE`` or "" (not given), ``GOMP_SPINCOUNT`` a count
    (libgomp's ``k``/``M``/``G``/``T`` suffixes allowed) or ``infinite`` ("" not given), and
    ``COLI_NO_OMP_TUNE`` 1 when given with any value (the engine tests its presence): how long
    the team's idle threads spin between regions (:func:`replay.colibri.openmp_team.team_spin_iterations`).
    ``OMP_PROC_BIND`` (libgomp's values, a comma list) and ``OMP_PLACES`` ("" not given): whether
    the team is bound to cores (:func:`replay.colibri.openmp_team.team_bound`).
    """

    PIPE: int = 0
    PIPE_WORKERS: int = 8
    URING: int = 0
    DIRECT: int = 0
    COLI_MMAP: int = 0
    COLI_PIPE_BLOCK: int = 0
    CAP: int = 0
    CAP_RAISE: int = 1
    RAM_GB: float = 0.0
    PIN: str = ""
    PIN_GB: float = 10.0
    AUTOPIN: int = 1
    COUPLE: str = ""
    COUPLE_K: int = 8
    COUPLE_D: int = 1
    PILOT: int = 0
    PILOT_REAL: int = 0
    PILOT_K: int = 0
    PILOT_WORKERS: int = 1
    PILOT_EVICT_GUARD: int = 1
    PILOT_TWO: int = 0
    OMP_NUM_THREADS: int = 0
    OMP_WAIT_POLICY: str = ""
    GOMP_SPINCOUNT: str = ""
    COLI_NO_OMP_TUNE: int = 0
    OMP_PROC_BIND: str = ""
    OMP_PLACES: str = ""

    def to_env(self) -> str:
        """The variables that differ from the engine's defaults, as ``NAME=VALUE`` words ("" for the defaults)."""
        base = EngineConfig()
        words = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v != getattr(base, f.name):
                words.append(f"{f.name}={_text(f.name, v)}")
        return " ".join(words)

    def to_json(self) -> dict:
        return asdict(self)


def _text(name: str, v) -> str:
    if name == "PIN_GB" and v < 0:
        return "all"
    if isinstance(v, float):
        return f"{v:g}"
    return shlex.quote(str(v)) if isinstance(v, str) else str(v)


@dataclass(frozen=True)
class RunFacts:
    """What a run's output says beyond its variables: the LRU cap it resolved (experts per layer),
    the experts it pinned, its OpenMP team's width, its expert matmuls' rate (bytes of weights
    per second, from the last ``P0-EXEC`` line: weight bytes per expert call over the calls'
    seconds, the model's per-position rate where each call has one row, as in decode), the
    memory available when it started (bytes: the ``[PROF] machine`` line's, at most what the
    run's memory control group left it), the machine's cores (the ``[PROF] machine``
    line), the rate one of its threads read experts it had read recently when every such read
    was buffered (bytes/s per thread, the ``[PROF] DISK-CLASS`` line's warm class, over the whole
    run: page-cache copies, as the engine copies them), the same for the experts it had not read
    recently (the cold class: mostly drive reads) and the thread time of one decode load (s:
    the decode ``PROFILE`` line's ``service`` over the ``[PROF] expert I/O`` line's loads and the
    router pilot's (its ``PILOT_REAL:`` line: ``service`` times its loads too, and it loads only
    in decode); the engine times each load whole, ``expert_load``; not under URING=1, which does
    not time them),
    the share of the router pilot's predictions the next layer routed (``LOOKA=1``'s ``next layer
    (PILOT, stale)`` line: hits over the next layers' routed experts, the pilot predicting as many
    as the router selects) and the main thread's time per decode forward outside expert waits,
    expert matmuls and the LM head (s: the decode ``PROFILE`` line's attention and other over its
    forwards, when the run printed them: when the router pilot loads between two layers' expert
    work); under PILOT_TWO the precision is its two-step line's; None where the output does not say."""

    cap: int | None = None
    pinned: int | None = None
    omp_threads: int | None = None
    matmul_bytes_per_second: float | None = None
    available_bytes: float | None = None
    cores: int | None = None
    warm_read_bytes_per_second: float | None = None
    cold_read_bytes_per_second: float | None = None
    decode_load_seconds: float | None = None
    pilot_precision: float | None = None
    between_layers_seconds: float | None = None


_INT = re.compile(r"[0-9]+\Z")
_FLOAT = re.compile(r"[0-9]+(\.[0-9]*)?\Z|\.[0-9]+\Z")


def _value(name: str, text: str, where: str):
    if name in FLAGS:
        if text not in ("0", "1"):
            raise InputError(where, f"{name} must be 0 or 1 (got {text!r})")
        return int(text)
    if name == "COLI_NO_OMP_TUNE":
        return 1
    if name == "OMP_WAIT_POLICY":
        if text.upper() not in ("ACTIVE", "PASSIVE"):
            raise InputError(where, f"OMP_WAIT_POLICY must be ACTIVE or PASSIVE (got {text!r})")
        return text.upper()
    if name == "OMP_PROC_BIND":
        items = [w.strip().lower() for w in text.split(",")]
        if not all(w in ("true", "false", "master", "primary", "close", "spread") for w in items):
            raise InputError(where, f"OMP_PROC_BIND must be true, false, or a list of primary, master, close, spread "
                                    f"(got {text!r})")
        return ",".join(items)
    if name == "OMP_PLACES":
        if not text.strip():
            raise InputError(where, "OMP_PLACES needs a place list (got an empty value)")
        return text
    if name == "GOMP_SPINCOUNT":
        if not SPIN_COUNT_TEXT.match(text):
            raise InputError(where, f"GOMP_SPINCOUNT must be a whole number (with k, M, G or T) or infinite (got {text!r})")
        return text
    if name in ("PIN", "COUPLE"):
        if not text:
            raise InputError(where, f"{name} needs a file (got an empty value)")
        return text
    if name == "PIN_GB" and text == "all":
        return -1.0
    if name in ("RAM_GB", "PIN_GB"):
        if not _FLOAT.match(text):
            raise InputError(where, f"{name} must be a number of GB >= 0 (got {text!r})")
        return float(text)
    if not _INT.match(text):
        raise InputError(where, f"{name} must be a whole number (got {text!r})")
    n = int(text)
    ranges = {"PIPE_WORKERS": (1, 64), "CAP": (0, 1 << 20), "COUPLE_K": (1, 32), "COUPLE_D": (1, 2), "PILOT_K": (1, 64),
              "PILOT_WORKERS": (1, 16), "OMP_NUM_THREADS": (1, 1024)}
    lo, hi = ranges[name]
    if not lo <= n <= hi:
        raise InputError(where, f"{name} must be {lo}-{hi} (got {n})")
    return n


def _is_name(name: str) -> bool:
    return bool(name) and (name[0].isalpha() or name[0] == "_") and name.replace("_", "").isalnum()


def env_words(text: str | None, where: str = "--runtime-env", *, strict: bool = True) -> dict[str, str]:
    """The ``NAME=VALUE`` words of ``text`` (shell quoting allowed), by name, as given.

    One set of rules for every reader of the engine's variables: each word is ``NAME=VALUE``
    with ``NAME`` a variable name (a letter or ``_``, then letters, digits, ``_``); a name is
    given once; the value of each read-path variable (an :class:`EngineConfig` field) is checked
    as the engine reads it (a flag 0 or 1, a file name not empty, a number of GB, a whole
    number in range). Variables that do not change how experts are read (:data:`NO_READ_EFFECT`)
    are kept unchecked.

    Parameters
    ----------
    text : str or None
        The words (None or "" for none).
    where : str
        What an error names (the option the words came from).
    strict : bool
        Refuse any other variable (a configuration to model); else keep it as given (an
        environment to run the engine with).

    Returns
    -------
    dict
        Each word's value by its name, as given (strings), in the words' order.

    Raises
    ------
    InputError
        Naming the word or the variable.

    Examples
    --------
    >>> env_words("PIPE=1 RAM_GB=128 TEMP=0")
    {'PIPE': '1', 'RAM_GB': '128', 'TEMP': '0'}
    >>> env_words("PIPE=1 DRAFT=4", strict=False)
    {'PIPE': '1', 'DRAFT': '4'}
    """
    try:
        words = shlex.split(text or "")
    except ValueError as exc:
        raise InputError(where, f"cannot split {text!r} into NAME=VALUE words: {exc}") from None
    known = {f.name for f in fields(EngineConfig)}
    out: dict[str, str] = {}
    for w in words:
        name, eq, value = w.partition("=")
        if not eq or not _is_name(name):
            raise InputError(where, f"takes NAME=value words, got {w!r}")
        if name in out:
            raise InputError(where, f"{name} is given twice")
        if name in known:
            _value(name, value, where)
        elif strict and name not in NO_READ_EFFECT:
            raise InputError(where, f"unknown variable {name} (read-path variables: {', '.join(sorted(known))}; "
                                    f"ignored: {', '.join(NO_READ_EFFECT)})")
        out[name] = value
    return out


def parse_runtime_env(text: str, where: str = "--runtime-env", base: EngineConfig | None = None) -> EngineConfig:
    """An :class:`EngineConfig` from ``NAME=VALUE`` words (:func:`env_words`, strict: an unknown
    variable or a malformed value is one error naming it; :data:`NO_READ_EFFECT` variables are
    ignored). Rules the engine applies when it starts: ``URING=1`` implies ``PIPE=1``;
    ``PIPE_WORKERS`` given without ``PIPE`` implies ``PIPE=1``; ``PILOT_TWO=1`` implies ``PILOT=1``;
    ``URING=1`` with ``COLI_MMAP=1`` is refused (the engine exits).

    Parameters
    ----------
    text : str
        The words, e.g. ``"PIPE=1 DIRECT=1 CAP=4"``.
    where : str
        What an error names.
    base : EngineConfig, optional
        The configuration the words change (default: the engine's defaults).

    Returns
    -------
    EngineConfig

    Raises
    ------
    InputError
        Naming the variable.

    Examples
    --------
    >>> parse_runtime_env("URING=1 RAM_GB=128 PROMPT='a b'").PIPE
    1
    """
    given = {name: _value(name, value, where) for name, value in env_words(text, where).items()
             if name not in NO_READ_EFFECT}
    cfg = replace(base or EngineConfig(), **given)
    if cfg.URING and cfg.COLI_MMAP:
        raise InputError(where, "URING=1 with COLI_MMAP=1: the engine refuses this combination")
    if cfg.URING or ("PIPE_WORKERS" in given and "PIPE" not in given and base is None):
        cfg = replace(cfg, PIPE=1)
    if cfg.PILOT_TWO:
        cfg = replace(cfg, PILOT=1)
    return cfg


_CONFIG_LINE = re.compile(r"\[PROF\] config: RAM_GB=(auto )?([0-9.]+) CTX=\d+ \| expert cache cap (\d+)/layer .*?"
                          r"\| pinned (\d+) .*?PIPE=(\d) DIRECT=(\d) MMAP=(\d) .*?PILOT=(\d)")
_MACHINE_LINE = re.compile(r"\[PROF\] machine: .*\| (\d+) cores \((\d+) omp threads\) \| RAM [0-9.]+ GB total, "
                           r"([0-9.]+) GB available")
_URING_LINE = re.compile(r"\[URING\] queued expert I/O active \(depth=\d+, workers=(\d+)")
_EXEC_LINE = re.compile(r"P0-EXEC: routed CPU ([0-9.]+)s / ([0-9.]+) GB/s")
_DISK_CLASS_LINE = re.compile(r"\[PROF\] DISK-CLASS \(recency split\): cold (\d+) x [0-9.]+ GB @ ([0-9.]+) "
                              r"GB/s-thread, .*?\(direct (\d+)/\d+\) \| warm (\d+) x [0-9.]+ GB @ ([0-9.]+) "
                              r"GB/s-thread, .*?\(direct (\d+)/(\d+)\)")


_TUNING_LINE = re.compile(r"\[OMP\] hot-thread tuning: re-exec")
_PILOT_TWO_LINE = re.compile(r"PILOT_TWO: two-step shared-expert-corrected prefetch active")
_PILOT_K_LINE = re.compile(r"PILOT_REAL: \d+ load cross-layer completati, .*\| PILOT_K=(\d+)")
_COUPLE_LINE = re.compile(r"\[COUPLE\] (.+): \d+ conditioning entries, K=(\d+) depth=(\d+)")

PILOT_VARIABLES = ("PILOT_K", "PILOT_WORKERS", "PILOT_EVICT_GUARD", "PILOT_TWO", "COUPLE", "COUPLE_K", "COUPLE_D")
"""The prefetchers' variables a run's output does not print, read from a measured run's recorded environment."""

RUN_FILES = ("stdout.txt", "stderr.txt")
"""A run directory's output files (as ``relayout measure --engine`` keeps them)."""


def config_from_run(path: str | Path) -> tuple[EngineConfig, RunFacts]:
    """The effective configuration a colibrì run printed (its stdout and stderr in one file, or a
    directory holding :data:`RUN_FILES`; run with ``PROF=1``): the ``[PROF] config`` line (RAM_GB, cap, pins, PIPE, DIRECT, MMAP, PILOT),
    the ``PILOT_REAL:`` line (PILOT_REAL=1 and its PILOT_K), the ``[COUPLE]`` line (the pair
    table it loaded, COUPLE_K, COUPLE_D; without it, no COUPLE),
    the ``[PROF] machine`` line (the machine's cores, the OpenMP team, the memory available), the
    ``[URING]`` line (URING=1 and its workers, the smaller of PIPE_WORKERS and 64), the
    ``P0-EXEC`` line (the matmul rate) and the ``[PROF] DISK-CLASS`` line (the warm reads' rate
    per thread, when they were all buffered). How the OpenMP team waits: ``COLI_NO_OMP_TUNE=1``
    when the output lacks the engine's ``[OMP] hot-thread tuning`` line, and, from a run directory
    ``relayout measure --engine`` made, the :data:`OPENMP_VARIABLES` and :data:`PILOT_VARIABLES`
    its recorded environment set, and the memory its control group left it
    (``RunIdentity.memory_room``), which bounds the memory available.
    Variables the output does not show keep the engine's defaults. The cap the run resolved, and
    the rest the output says, are in ``RunFacts``. Raises :class:`InputError` when the file has
    no ``[PROF] config`` line."""
    p = Path(path)
    files = [p / n for n in RUN_FILES if (p / n).is_file()] if p.is_dir() else [p]
    if not files:
        raise InputError(str(p), f"a run directory needs {' or '.join(RUN_FILES)}")
    try:
        text = "\n".join(f.read_text(errors="replace") for f in files)
    except OSError as exc:
        raise InputError(str(p), f"cannot read the run's output: {exc.strerror or exc}") from None
    m = _CONFIG_LINE.search(text)
    if not m:
        raise InputError(str(p), "no '[PROF] config:' line: run the engine with PROF=1 and keep its stderr")
    auto, ram, cap, pinned, pipe, direct, mmap, pilot = m.groups()
    cfg = EngineConfig(PIPE=int(pipe), DIRECT=int(direct), COLI_MMAP=int(mmap), PILOT=int(pilot), CAP=int(cap),
                       CAP_RAISE=0, RAM_GB=0.0 if auto else float(ram))
    if not _TUNING_LINE.search(text):
        cfg = replace(cfg, COLI_NO_OMP_TUNE=1)
    pk = _PILOT_K_LINE.search(text)
    if pk:
        cfg = replace(cfg, PILOT_REAL=1, PILOT_K=int(pk.group(1)))
    if _PILOT_TWO_LINE.search(text):
        cfg = replace(cfg, PILOT_TWO=1)
    room = None
    if p.is_dir() and (p / RUN_FILE).is_file():
        where = str(p / RUN_FILE)
        identity = RunIdentity.from_json(parse_json(read_bytes(p / RUN_FILE)), where)
        env, room = identity.env, identity.memory_room
        cfg = replace(cfg, **{k: _value(k, str(env[k]), where) for k in OPENMP_VARIABLES + PILOT_VARIABLES if k in env})
    couple = _COUPLE_LINE.search(text)
    if couple:                                # the table the engine loaded (a relative path is the run directory's)
        table = Path(couple.group(1))
        table = table if table.is_absolute() or not p.is_dir() else p / table
        cfg = replace(cfg, COUPLE=str(table), COUPLE_K=int(couple.group(2)), COUPLE_D=int(couple.group(3)))
    else:                                     # not loaded: the engine ran without it
        cfg = replace(cfg, COUPLE="")
    u = _URING_LINE.search(text)
    if u:
        cfg = replace(cfg, URING=1, PIPE=1, PIPE_WORKERS=max(1, min(int(u.group(1)), 64)))
    mt = _MACHINE_LINE.search(text)
    ex = ([None] + list(_EXEC_LINE.finditer(text)))[-1]
    rate = float(ex.group(2)) * 1e9 if ex and float(ex.group(2)) > 0 else None
    dc = ([None] + list(_DISK_CLASS_LINE.finditer(text)))[-1]
    warm = (float(dc.group(5)) * 1e9 if dc and int(dc.group(4)) > 0 and int(dc.group(6)) == 0
            and float(dc.group(5)) > 0 else None)
    cold = (float(dc.group(2)) * 1e9 if dc and int(dc.group(1)) > 0 and int(dc.group(3)) == 0
            and float(dc.group(2)) > 0 else None)
    out = parse_engine_output(text, str(p)) if "PROFILE: expert-disk" in text else None
    loads = (out.expert_io.loads + (out.pilot_loads or 0)) if out is not None and out.expert_io is not None else 0
    load = (out.decode.service_s / loads if out is not None and out.decode is not None
            and loads > 0 and out.decode.service_s > 0 and not cfg.URING else None)
    look = (out.pilot_two_lookahead if cfg.PILOT_TWO else out.pilot_lookahead) if out is not None else None
    precision = look[0] / look[1] if look and look[1] > 0 else None
    forwards = out.forwards.forwards if out is not None and out.forwards is not None else None
    between = ((out.decode.attention_s + out.decode.other_s) / forwards
               if forwards and out.decode is not None else None)
    available = float(mt.group(3)) * 1e9 if mt else None
    if room is not None:                      # a memory limit bounds the page cache the run kept
        available = float(room) if available is None else min(available, float(room))
    return cfg, RunFacts(int(cap), int(pinned), int(mt.group(2)) if mt else None, rate, available,
                         int(mt.group(1)) if mt else None, warm, cold, load, precision, between)


MIXED_CLASS_FACTOR = 4.0
"""How much faster than its cold class a memory-limited run's warm class must have read for its
rate to be taken as the page-cache copies' (:func:`engine_copy_rate`)."""


def engine_copy_rate(cfg: EngineConfig, facts: RunFacts, layout) -> float:
    """The rate one of a run's threads copied page-cache hits at (bytes/s per thread), by the run's
    own measurements; 0.0 when it gives none.

    With buffered weights, a decode load's bytes (the mean expert of ``layout``, the container
    the run read: weights and scales) over its thread time (:attr:`RunFacts.decode_load_seconds`):
    in a decode the page cache serves nearly every load (each prompt's prefill read the experts),
    and the time is the engine's whole load, in the window S is taken over. Else the
    ``[PROF] DISK-CLASS`` warm class's rate (:attr:`RunFacts.warm_read_bytes_per_second`, the
    whole run). A decode whose loads mostly reach the drives gives a rate no faster than the
    drives, which :func:`at_engine_copy_rate` sets aside. A run of several router-pilot threads
    (PILOT_WORKERS > 1 under PILOT_REAL, not URING) gives none: its loading threads outnumber the
    cores they share, and a load's thread time includes the time it waited for the others
    (measured: 4.5 GB/s per thread against 7.0 with one pilot thread, docs/BENCHMARKS.md). A run
    whose page cache could not hold the container's experts (:func:`memory_terms`, e.g. under a
    memory limit) mixes page-cache copies with drive reads in its decode loads and in either
    class: it gives its warm class's rate only when that is at least :data:`MIXED_CLASS_FACTOR`
    times its cold class's (then at most a quarter of the warm class's bytes, read no faster
    than the cold class's, came from the drives), else none.
    """
    if cfg.PILOT_REAL and cfg.PILOT_WORKERS > 1 and not cfg.URING:
        return 0.0
    if not cfg.DIRECT and facts.available_bytes and memory_terms(cfg, facts, layout, 0)[1] < layout.expert_bytes().sum():
        warm, cold = facts.warm_read_bytes_per_second, facts.cold_read_bytes_per_second
        return warm if warm and cold and warm >= MIXED_CLASS_FACTOR * cold else 0.0
    if not cfg.DIRECT and facts.decode_load_seconds:
        return float(layout.expert_bytes().astype(float).mean()) / facts.decode_load_seconds
    return facts.warm_read_bytes_per_second or 0.0


def aligned_copy_fraction(layout) -> float:
    """The share of an expert's bytes (weights and scales, every expert of ``layout``, a
    :class:`containers.layout.Layout`) that start on a cache line, so copy at the aligned rate
    (:data:`replay.model.device.COPY_ALIGNMENT`)."""
    from replay.model.device import COPY_ALIGNMENT

    loc = layout.expert_loc
    nbytes = loc[..., 2].astype(float)
    total = nbytes.sum()
    return float((nbytes * (loc[..., 1] % COPY_ALIGNMENT == 0)).sum() / total) if total > 0 else 1.0


def at_engine_copy_rate(device, warm_read_bytes_per_second: float, layout):
    """``device`` (an :class:`replay.model.device.ArrayProfile`) with its page-cache copy rates
    scaled so that the container ``layout`` the engine ran copies, on average over its bytes, at
    the rate the engine measured for its own buffered warm reads (bytes/s per thread,
    :attr:`RunFacts.warm_read_bytes_per_second`). Both rates move by one factor, so the aligned and
    unaligned rates keep the ratio the calibration measured and a rewrite with other alignments
    is predicted at it.

    The engine's warm class is the experts it read recently, which the page cache usually still
    holds; when that rate is no faster than the drives (``host_bandwidth``) those reads reached
    the drives, it says nothing of copies, and ``device`` is returned as it is.

    The calibration times one Python thread copying whole buffers; colibrì's threads copy six
    tensors per expert, two at a time on a 2-core machine, beside its own work, and on the
    machine of docs/BENCHMARKS.md ("The engine's own copy rate") the two differed by a quarter."""
    if warm_read_bytes_per_second <= device.host_bandwidth:
        return device
    aligned = aligned_copy_fraction(layout)
    per_byte = aligned / device.memory_bandwidth + (1.0 - aligned) / device.unaligned_copy_rate
    factor = warm_read_bytes_per_second * per_byte
    return replace(device, name=f"{device.name}, page-cache copies at the engine's {warm_read_bytes_per_second / 1e9:.2f} GB/s",
                   memory_bandwidth=device.memory_bandwidth * factor,
                   unaligned_memory_bandwidth=(None if device.unaligned_memory_bandwidth is None
                                               else device.unaligned_memory_bandwidth * factor))


def engine_cap(cfg: EngineConfig, n_experts: int, row_bytes: float, resident_bytes: float, widest_expert_bytes: float,
               kv_bytes: float = 0.0) -> int:
    """Experts per layer colibrì's LRU holds under ``cfg`` (``cap_for_ram``'s rule).

    The requested cap (``CAP``; 64 when not given) is lowered to what the RAM budget pays for,
    ``floor((RAM_GB - resident - reserve) / row_bytes)`` (at least 1), and, when the budget pays for
    more and ``CAP_RAISE`` is 1, raised to it (at most ``n_experts``). ``row_bytes``: one slot in
    every MoE layer (bytes); ``resident_bytes``: dense weights and pinned experts; the reserve is
    :data:`SLACK_BYTES`, 64 slabs of the widest expert and ``kv_bytes`` (the KV cache at CTX).
    With ``RAM_GB`` 0 (auto: a share of the engine machine's free memory, unknown here) the
    requested cap is kept.
    """
    cap = cfg.CAP or 64
    if cfg.RAM_GB <= 0:
        return cap
    avail = cfg.RAM_GB * 1e9 - resident_bytes - (SLACK_BYTES + WORKING_SET_SLOTS * widest_expert_bytes + kv_bytes)
    capmax = max(int(avail / row_bytes) if avail > 0 and row_bytes > 0 else 0, 1)
    if capmax < cap:
        return capmax
    if cfg.CAP_RAISE and min(capmax, n_experts) > cap:
        return min(capmax, n_experts)
    return cap


def memory_terms(cfg: EngineConfig, facts: RunFacts | None, layout, pin_bytes: int) -> tuple[int, int]:
    """The LRU's experts per layer and the page cache's bytes for experts (weights and scales) a
    colibrì run has on ``layout`` (a :class:`containers.layout.Layout`).

    The LRU: the cap the run printed (``facts``), else :func:`engine_cap` when ``CAP`` or
    ``RAM_GB`` is given (the container's bytes outside routed experts, plus ``pin_bytes``, as
    resident), else -1 (the model's ``ram_bytes`` then sizes it). The page cache: with buffered
    weights and a run that printed the memory available at its start, what the run left of it:
    available less resident, the LRU's slots and the working slabs (one per expert a layer's
    misses can load at once, at most ``WORKING_SET_SLOTS``: colibrì allocates a slab when a load
    first uses it); under COLI_MMAP=1 the slots are views of the page cache and hold no copies:
    available less resident; else 0.
    """
    eb = layout.expert_bytes().astype(float)
    row, widest = float(eb[:, 0].sum()), float(eb.max())
    resident = float(sum(layout.file_sizes)) - float(eb.sum()) + pin_bytes
    lru = -1
    if facts is not None and facts.cap is not None:
        lru = facts.cap
    elif cfg.CAP or cfg.RAM_GB:
        lru = engine_cap(cfg, layout.n_experts, row, resident, widest)
    page = 0
    if cfg.COLI_MMAP and facts is not None and facts.available_bytes:     # views: the slots hold no copies
        page = int(max(facts.available_bytes - resident, 0.0))
    elif not cfg.DIRECT and facts is not None and facts.available_bytes:
        slabs = min(WORKING_SET_SLOTS, layout.n_experts)
        page = int(max(facts.available_bytes - resident - max(lru, 0) * row - slabs * widest, 0.0))
    return lru, page


def not_modelled(cfg: EngineConfig) -> list[str]:
    """The variables of ``cfg`` the model has no read path for (each a sentence); empty when it models them all."""
    return ["COUPLE_D=2 (the table's loads two layers ahead) is not modelled"] if cfg.COUPLE and cfg.COUPLE_D > 1 else []


def model_config(cfg: EngineConfig, base: RuntimeConfig, lru_experts: int, omp_threads: int | None = None,
                 pin_bytes: int = 0, cores: int | None = None, pilot_precision: float | None = None) -> RuntimeConfig:
    """The model's configuration for a colibrì run under ``cfg``: its read path named as the engine
    runs it, the rest (compute model, dense time, relayout-only policies) from ``base``.

    PIPE=0: one blocking batch per layer on the OpenMP team (``omp_threads`` wide; default
    ``OMP_NUM_THREADS``, else this machine's cores). PIPE=1: PIPE_WORKERS loader threads (at most
    16), the compute thread waiting per expert, each block handed over at the cost the device profile
    measured when they share its core. URING=1: up to 64 loads in flight, waits per expert. DIRECT=1:
    O_DIRECT weight reads (scales stay buffered). COLI_MMAP=1: buffered, the experts views of the page
    cache (``RuntimeConfig.mapped_views``: a page-cache hit costs re-touching mapped pages, at the rate a
    run of it measured; DIRECT is then moot). Misses in routing order. The LRU holds ``lru_experts`` per
    layer (:func:`engine_cap`, or the cap a run printed). The page-cache copies run at most ``cores``
    at once (``RuntimeConfig.cpu_cores``: the cores of the
    machine the run printed, else this machine's), less those the OpenMP team keeps from them
    (:func:`replay.colibri.openmp_team.team_held_cores`). PILOT_REAL=1: the router pilot's loads
    (the ``pilot`` prefetch source, at ``pilot_precision``, PILOT_K per position, default 6; its
    eviction guard as PILOT_EVICT_GUARD says; each layer waiting for the loads in flight on it,
    ``RuntimeConfig.layer_barrier``; PILOT_WORKERS threads loading its queue, one under URING=1);
    with COUPLE, its table's COUPLE_K best per position queued after the pilot's
    (``RuntimeConfig.couple_file``; the caller reads the table, :func:`replay.formats.colipairs.configured_pair_table`).
    PILOT=1 without PILOT_REAL: the same lists as page-cache hints (``RuntimeConfig.prefetch_hints``,
    PILOT_K default 8); COUPLE alone: the ``coupled`` source on its file's table, as hints. Raises
    :class:`InputError` for what the model does not run (:func:`not_modelled`) and for PILOT_REAL=1 without a precision.
    """
    missing = not_modelled(cfg)
    if missing:
        raise InputError("--runtime-env", "; ".join(missing))
    pilot = cfg.PILOT or cfg.PILOT_REAL
    if pilot and not pilot_precision:
        raise InputError("--runtime-env", f"{'PILOT_REAL' if cfg.PILOT_REAL else 'PILOT'}=1: the router pilot's "
                                          "predictions are not in a routing trace; the model draws them at the pilot's "
                                          "measured precision: give --pilot-precision, or --runtime-env-from a PROF=1 "
                                          "run with LOOKA=1 (its 'next layer (PILOT, stale)' line)")
    if pilot:
        base = replace(base, prefetch="pilot", prefetch_experts=cfg.PILOT_K or (6 if cfg.PILOT_REAL else 8),
                       pilot_precision=float(pilot_precision), evict_guard=bool(cfg.PILOT_REAL and cfg.PILOT_EVICT_GUARD),
                       layer_barrier=bool(cfg.PILOT_REAL), prefetch_hints=not cfg.PILOT_REAL, admission="top-k",
                       couple_file=cfg.COUPLE, couple_experts=cfg.COUPLE_K if cfg.COUPLE else 0)
    elif cfg.COUPLE:
        base = replace(base, prefetch="coupled", prefetch_experts=cfg.COUPLE_K, couple_file=cfg.COUPLE,
                       prefetch_hints=True, admission="top-k")
    team = omp_threads or cfg.OMP_NUM_THREADS or os.cpu_count() or 1
    if cfg.URING:
        workers, batched, blocking = base.workers, True, False
    elif cfg.PIPE:
        workers, batched, blocking = max(1, min(cfg.PIPE_WORKERS, PIPE_POOL_MAX)), False, False
    else:
        workers, batched, blocking = team, False, True
    cpu_cores = int(cores or os.cpu_count() or 1)
    return replace(base, workers=workers, batched=batched, blocking=blocking,
                   direct=bool(cfg.DIRECT) and not cfg.COLI_MMAP, mapped_views=bool(cfg.COLI_MMAP), routing_order=True,
                   lru_experts=int(lru_experts), pin_bytes=int(pin_bytes), cpu_cores=cpu_cores,
                   team_held_cores=team_held_cores(cfg, team, cpu_cores), loaders_on_compute_core=loaders_on_compute_core(cfg),
                   copy_threads=URING_COPY_THREADS if cfg.URING else 0,
                   pilot_workers=cfg.PILOT_WORKERS if cfg.PILOT_REAL and not cfg.URING else 1,
                   engine_env=cfg.to_env() or "(defaults)")
