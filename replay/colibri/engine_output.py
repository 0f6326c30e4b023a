"""What a colibrì engine run printed, read into one record: :class:`EngineRun`.

This module owns two formats: the engine's own text output (its stdout and stderr, read as
printed; nothing is asked of the engine but ``PROF=1`` for the ``[PROF]`` lines and ``TOKENS=1``
for the token ids) and a measured run's directory as ``relayout measure --engine`` writes it
(:data:`RUN_FILE` with the run's identity and environment, the engine's :data:`STDOUT_FILE`,
:data:`STDERR_FILE` and its ``ROUTE_TRACE`` file :data:`ROUTE_FILE`).

Lines read (each the engine's own words; times in seconds as printed, at millisecond precision):

- ``PROFILE: expert-disk <s>s service / <s>s wait | expert-matmul <s>s | attention <s>s
  (including kvb <s>s) | lm_head <s>s | other <s>s``. Text mode prints one after prefill
  (after ``PROFILO PREFILL``) and one for the decode; the decode's is the last. ``wait`` is the
  time the compute thread was blocked on expert bytes: the foreground stall. ``service`` is the
  loading threads' read time (overlapping compute; 0 in ``URING`` mode, which does not time it).
- ``prefill <n> tokens in <s>s | decode <n> tokens in <s>s ...``: the committed tokens of the
  decode window and its wall time (text mode).
- ``[PROF] config: RAM_GB=[auto ]<GB> CTX=<n> | expert cache cap <n>/layer ... | DRAFT=<n> PIPE=<n>
  DIRECT=<n> MMAP=<n> ...``: the effective configuration (stderr).
- ``[RAM_GB=<GB>[ auto]] cap=<n> ok`` / ``cap raised <a>-><b>`` / ``cap lowered <a>-><b>``: the
  RAM budget and what it made of the cache cap (stderr).
- ``[PROF] decode forwards: <n> | latency p50 <ms> ms | p90 ... | p99 ... | max ... | <x> tok/forward``.
- ``[PROF] expert I/O: <GB> GB fetched ... | hit <pct>% (<pin> pin + <lru> lru / <loads> load) |
  <x> loads/token | <s>s read service / <s>s felt wait``.
- Serve mode with ``SERVE_BATCH=1``, one per turn at the start of a line: ``PROF <wall_s> <prompt>
  <completion> <edisk> <ewait> <emm> <attn> <head> <n_fw>``. (Serve mode without it prints no
  ``PROFILE:`` line and no ``PROF`` line, only ``[PROF]`` lines at 0.1 s precision: not read.)

stdout and stderr captured into one file interleave mid-line (the generated text has no final
newline), so every line but serve's ``PROF`` is found anywhere in a line.
- ``TOKENS=1`` (stderr): ``[PROMPT_TOKENS] <n>: <ids>`` and ``[TOKENS] <n> generated: <ids>``.
- ``PILOT_REAL=1``: ``PILOT_REAL: <n> load cross-layer completati, <n> scartati ...``: the router
  pilot's loads completed, and its predictions dropped (the layer already reached, no slot, or
  the eviction guard).
- ``LOOKA=1``: ``next layer (PILOT, stale) <pct>%  (<hits>/<total>)`` under ``LOOKAHEAD routing``:
  of the next layers' routed experts, how many the router pilot's prediction held; ``next layer
  (two-step, shared-expert) ...`` the same for its two-step prediction (``PILOT_TWO``).

S, the foreground stall per committed token, is the decode window's ``wait`` over its committed
tokens (serve mode: the turns' summed ``ewait`` over their summed completion tokens).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import get_args, get_type_hints

from containers.atomic import write_json_atomic
from containers.errors import InputError
from containers.jsonfile import parse_json, read_bytes

RUN_FILE = "engine-run.json"
STDOUT_FILE = "stdout.txt"
STDERR_FILE = "stderr.txt"
ROUTE_FILE = "route-trace.txt"
RUN_FORMAT = "relayout-colibri-run"
RUN_VERSION = 2
"""Version 2 added ``memory_room`` and ``drive_read_bytes``; a version 1 record (without them)
reads with them None."""
_MAX_OUTPUT_BYTES = 256 << 20

_NUM = r"(-?\d+(?:\.\d+)?)"
_PROFILE = re.compile(
    rf"PROFILE: expert-disk {_NUM}s service / {_NUM}s wait \| expert-matmul {_NUM}s \| attention {_NUM}s "
    rf"\(including kvb {_NUM}s\) \| lm_head {_NUM}s \| other {_NUM}s\s*$")
_PREFILL_MARK = re.compile(r"PROFILO PREFILL \(")
_DECODE = re.compile(rf"prefill (\d+) tokens in {_NUM}s \| decode (\d+) tokens in {_NUM}s")
_CONFIG = re.compile(r"\[PROF\] config: (.*\S)\s*$")
_CONFIG_RAM = re.compile(rf"RAM_GB=(auto )?{_NUM}")
_CONFIG_CAP = re.compile(r"expert cache cap (\d+)/layer")
_CONFIG_PAIR = re.compile(r"\b([A-Z][A-Z_]*)=(\S+)")
_RAM = re.compile(rf"\[RAM_GB={_NUM}( auto)?\] (?:.*?cap (?:raised|lowered) (\d+)->(\d+)|cap=(\d+) ok)")
_FORWARDS = re.compile(
    rf"\[PROF\] decode forwards: (\d+) \| latency p50 {_NUM} ms \| p90 {_NUM} ms \| p99 {_NUM} ms \| "
    rf"max {_NUM} ms \| {_NUM} tok/forward")
_IO = re.compile(
    rf"\[PROF\] expert I/O: {_NUM} GB fetched .*\| hit {_NUM}% \((\d+) pin \+ (\d+) lru / (\d+) load\) \| "
    rf"{_NUM} loads/token \| {_NUM}s read service / {_NUM}s felt wait")
_SERVE = re.compile(rf"^PROF {_NUM} (\d+) (\d+) {_NUM} {_NUM} {_NUM} {_NUM} {_NUM} (\d+)\s*$")
_PROMPT_TOKENS = re.compile(r"\[PROMPT_TOKENS\] (\d+):((?: -?\d+)*)\s*$")
_TOKENS = re.compile(r"\[TOKENS\] (\d+) generated:((?: -?\d+)*)\s*$")
_PILOT_REAL = re.compile(r"PILOT_REAL: (\d+) load cross-layer completati, (\d+) scartati")
_LOOKAHEAD_PILOT = re.compile(r"next layer \(PILOT, stale\)\s+-?\d+(?:\.\d+)?%\s+\((\d+)/(\d+)\)")
_LOOKAHEAD_TWO = re.compile(r"next layer \(two-step, shared-expert\)\s+-?\d+(?:\.\d+)?%\s+\((\d+)/(\d+)\)")


def _fits(value, hint) -> bool:
    """Whether a JSON value has the type a record field is annotated with (bool is not a number)."""
    args = get_args(hint)
    if args and type(None) in args:
        return value is None or any(_fits(value, a) for a in args if a is not type(None))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _strict(cls, d, where: str, nested: dict | None = None):
    """Build dataclass ``cls`` from dict ``d``: exactly its fields, nested records by ``nested``."""
    if not isinstance(d, dict):
        raise InputError(where, f"expected an object for {cls.__name__}")
    names = {f.name for f in fields(cls)}
    if set(d) != names:
        missing, extra = sorted(names - set(d)), sorted(set(d) - names)
        raise InputError(where, f"{cls.__name__}: " + "; ".join(
            x for x in (f"missing {missing}" if missing else "", f"unknown {extra}" if extra else "") if x))
    kw = dict(d)
    hints = get_type_hints(cls)
    for name, value in kw.items():
        if name not in (nested or {}) and not _fits(value, hints[name]):
            raise InputError(where, f"{cls.__name__}.{name}: {type(value).__name__} where {hints[name]} belongs")
    for name, sub in (nested or {}).items():
        v = kw[name]
        if isinstance(v, list):
            kw[name] = [sub.from_json(x, where) for x in v]
        elif v is not None:
            kw[name] = sub.from_json(v, where)
    return cls(**kw)


@dataclass(frozen=True)
class Profile:
    """One ``PROFILE:`` line: seconds of the window it covers."""

    service_s: float
    wait_s: float
    matmul_s: float
    attention_s: float
    kvb_s: float
    lm_head_s: float
    other_s: float

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d, where: str = "profile") -> "Profile":
        return _strict(cls, d, where)


@dataclass(frozen=True)
class Forwards:
    """``[PROF] decode forwards``: forwards of the decode window, their latency quantiles (ms)."""

    forwards: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    tokens_per_forward: float

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d, where: str = "forwards") -> "Forwards":
        return _strict(cls, d, where)


@dataclass(frozen=True)
class ExpertIO:
    """``[PROF] expert I/O`` of the decode window: bytes fetched, cache hits and loads (misses)."""

    fetched_gb: float
    hit_percent: float
    pin_hits: int
    lru_hits: int
    loads: int
    loads_per_token: float
    read_service_s: float
    felt_wait_s: float

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d, where: str = "expert_io") -> "ExpertIO":
        return _strict(cls, d, where)


@dataclass(frozen=True)
class ServeTurn:
    """One serve-mode ``PROF`` line (a turn): seconds, and token and forward counts."""

    wall_s: float
    prompt_tokens: int
    completion_tokens: int
    service_s: float
    wait_s: float
    matmul_s: float
    attention_s: float
    lm_head_s: float
    forwards: int

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d, where: str = "serve_turn") -> "ServeTurn":
        return _strict(cls, d, where)


@dataclass(frozen=True)
class EngineOutput:
    """Everything read from one run's printed output; absent lines are ``None`` (or empty).

    ``config`` holds the ``[PROF] config`` line's ``NAME=value`` pairs as printed, ``cap`` the
    expert cache's experts per layer after the RAM budget's adjustment and ``requested_cap``
    what was asked when the budget raised or lowered it; ``ram_gb`` the budget in GB and
    ``ram_auto`` whether the engine chose it from available memory. ``pilot_loads`` and
    ``pilot_drops``: the router pilot's completed loads and dropped predictions (``PILOT_REAL=1``);
    ``pilot_lookahead``: ``[hits, total]``, the next layers' routed experts its prediction held
    (``LOOKA=1``); ``pilot_two_lookahead`` the same for its two-step prediction.
    """

    decode: Profile | None
    prefill: Profile | None
    prefill_tokens: int | None
    decode_tokens: int | None
    decode_s: float | None
    config: dict = field(default_factory=dict)
    config_line: str | None = None
    cap: int | None = None
    requested_cap: int | None = None
    ram_gb: float | None = None
    ram_auto: bool | None = None
    forwards: Forwards | None = None
    expert_io: ExpertIO | None = None
    serve_turns: list = field(default_factory=list)
    prompt_tokens: list | None = None
    output_tokens: list | None = None
    pilot_loads: int | None = None
    pilot_drops: int | None = None
    pilot_lookahead: list | None = None
    pilot_two_lookahead: list | None = None

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("decode", "prefill", "forwards", "expert_io"):
            d[k] = d[k].to_json() if d[k] is not None else None
        d["serve_turns"] = [t.to_json() for t in self.serve_turns]
        return d

    @classmethod
    def from_json(cls, d, where: str = "engine output") -> "EngineOutput":
        return _strict(cls, d, where, {"decode": Profile, "prefill": Profile, "forwards": Forwards,
                                       "expert_io": ExpertIO, "serve_turns": ServeTurn})

    @property
    def committed_tokens(self) -> int | None:
        """Tokens committed in the window S is taken over (decode window, or all serve turns)."""
        if self.serve_turns:
            return sum(t.completion_tokens for t in self.serve_turns)
        if self.decode_tokens is not None:
            return self.decode_tokens
        return len(self.output_tokens) if self.output_tokens is not None else None

    @property
    def wait_s(self) -> float | None:
        """Foreground stall of that window: seconds the compute thread waited for expert bytes."""
        if self.serve_turns:
            return sum(t.wait_s for t in self.serve_turns)
        return self.decode.wait_s if self.decode is not None else None


def parse_engine_output(text: str, where: str = "engine output") -> EngineOutput:
    """Read a run's printed output (stdout, stderr, or both in any interleaving).

    Parameters
    ----------
    text : the captured output.
    where : the file name, for errors.

    Returns
    -------
    :class:`EngineOutput`. Raises :class:`InputError` when the text holds no ``PROFILE:`` line
    and no serve ``PROF`` line (not a colibrì run's output, or a run that did not finish).
    """
    profiles: list[tuple[bool, Profile]] = []
    after_prefill_mark = False
    out: dict = {"prefill_tokens": None, "decode_tokens": None, "decode_s": None, "config": {}, "config_line": None,
                 "cap": None, "requested_cap": None, "ram_gb": None, "ram_auto": None, "forwards": None,
                 "expert_io": None, "serve_turns": [], "prompt_tokens": None, "output_tokens": None,
                 "pilot_loads": None, "pilot_drops": None, "pilot_lookahead": None, "pilot_two_lookahead": None}
    for raw in text.splitlines():
        line = raw.strip("\r")
        if _PREFILL_MARK.search(line):
            after_prefill_mark = True
        m = _PROFILE.search(line)
        if m:
            profiles.append((after_prefill_mark, Profile(*map(float, m.groups()))))
            after_prefill_mark = False
            continue
        m = _DECODE.search(line)
        if m:
            out["prefill_tokens"], out["decode_tokens"] = int(m[1]), int(m[3])
            out["decode_s"] = float(m[4])
            continue
        m = _CONFIG.search(line)
        if m:
            body = m[1]
            out["config_line"] = body
            ram = _CONFIG_RAM.search(body)
            pairs = dict(_CONFIG_PAIR.findall(body))
            if ram:
                pairs["RAM_GB"] = ("auto " if ram[1] else "") + ram[2]
            out["config"] = pairs
            cap = _CONFIG_CAP.search(body)
            if cap:
                out["cap"] = int(cap[1])
            continue
        m = _RAM.search(line)
        if m:
            out["ram_gb"], out["ram_auto"] = float(m[1]), bool(m[2])
            if m[5] is not None:
                out["cap"] = int(m[5])
            else:
                out["requested_cap"], out["cap"] = int(m[3]), int(m[4])
            continue
        m = _FORWARDS.search(line)
        if m:
            out["forwards"] = Forwards(int(m[1]), *map(float, m.groups()[1:]))
            continue
        m = _IO.search(line)
        if m:
            g = m.groups()
            out["expert_io"] = ExpertIO(float(g[0]), float(g[1]), int(g[2]), int(g[3]), int(g[4]), float(g[5]),
                                        float(g[6]), float(g[7]))
            continue
        m = _PILOT_REAL.search(line)
        if m:
            out["pilot_loads"], out["pilot_drops"] = int(m[1]), int(m[2])
            continue
        m = _LOOKAHEAD_PILOT.search(line)
        if m:
            out["pilot_lookahead"] = [int(m[1]), int(m[2])]
            continue
        m = _LOOKAHEAD_TWO.search(line)
        if m:
            out["pilot_two_lookahead"] = [int(m[1]), int(m[2])]
            continue
        m = _SERVE.match(line)
        if m:
            g = m.groups()
            out["serve_turns"].append(ServeTurn(float(g[0]), int(g[1]), int(g[2]), *map(float, g[3:8]), int(g[8])))
            continue
        for pattern, key in ((_PROMPT_TOKENS, "prompt_tokens"), (_TOKENS, "output_tokens")):
            m = pattern.search(line)
            if m:
                ids = [int(x) for x in m[2].split()]
                if len(ids) != int(m[1]):
                    raise InputError(where, f"{key}: the line announces {m[1]} ids and holds {len(ids)}")
                out[key] = ids
    if not profiles and not out["serve_turns"]:
        raise InputError(where, "no 'PROFILE: expert-disk' line and no serve 'PROF' line: not a finished colibrì run's output")
    decode = next((p for was_prefill, p in reversed(profiles) if not was_prefill), None)
    prefill = next((p for was_prefill, p in profiles if was_prefill), None)
    return EngineOutput(decode=decode, prefill=prefill, **out)


@dataclass(frozen=True)
class RunIdentity:
    """A measured run's identity and conditions, as ``relayout measure --engine`` records them.

    ``arm`` names the container measured (``baseline`` or ``container``), ``container`` its
    path; ``prompt`` the prompt's index in the prompts file; ``repetition`` from 0; ``env`` the
    engine's environment variables the run set (the runtime configuration in the engine's terms,
    plus ``SNAP``, ``PROMPT`` and the like); ``argv`` the command; ``cold`` how the page cache was
    controlled; ``returncode`` the engine's exit status; ``wall_s`` the run's wall time;
    ``load_average`` the 1-minute load average when it started (a shared machine);
    ``memory_room`` the bytes its memory control group let the engine add when it started (the
    group's limit less the anonymous memory already charged to it: a bound on the page cache the
    run could keep, ``relayout.workflows.memory_room``), None when no limit applied;
    ``drive_read_bytes`` the bytes the engine process read from storage (its block input, as the
    kernel counts it for a child waited for: page-cache hits excluded), None where not counted.
    """

    arm: str
    container: str
    prompt: int
    repetition: int
    env: dict
    argv: list
    cold: str
    returncode: int
    wall_s: float
    load_average: float
    started_utc: str
    memory_room: int | None = None
    drive_read_bytes: int | None = None

    def to_json(self) -> dict:
        return {"format": RUN_FORMAT, "version": RUN_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, d, where: str = RUN_FILE) -> "RunIdentity":
        if not isinstance(d, dict) or d.get("format") != RUN_FORMAT or d.get("version") not in (1, RUN_VERSION):
            raise InputError(where, f"not a {RUN_FORMAT} version 1 or {RUN_VERSION} record")
        body = {k: v for k, v in d.items() if k not in ("format", "version")}
        added = ("memory_room", "drive_read_bytes")
        if d["version"] == 1:
            if any(k in body for k in added):
                raise InputError(where, f"RunIdentity: unknown {[k for k in added if k in body]} in a version 1 record")
            body.update({k: None for k in added})
        for k in added:
            v = body.get(k)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise InputError(where, f"RunIdentity.{k}: bytes >= 0 or null (got {v!r})")
        return _strict(cls, body, where)


@dataclass(frozen=True)
class EngineRun:
    """One run: where its output came from, its identity when measured by relayout, what it printed."""

    source: str
    identity: RunIdentity | None
    output: EngineOutput
    route_trace: str | None

    def to_json(self) -> dict:
        return {"source": self.source, "identity": self.identity.to_json() if self.identity else None,
                "output": self.output.to_json(), "route_trace": self.route_trace}

    @classmethod
    def from_json(cls, d, where: str = "engine run") -> "EngineRun":
        return _strict(cls, d, where, {"identity": RunIdentity, "output": EngineOutput})


def write_run_identity(run_dir: str | Path, identity: RunIdentity) -> Path:
    """Write ``run_dir/RUN_FILE`` crash-safely (temp, fsync, rename); written last, it marks the run complete."""
    path = Path(run_dir) / RUN_FILE
    write_json_atomic(path, identity.to_json())
    return path


def _text(path: Path) -> str:
    data = read_bytes(path)
    if len(data) > _MAX_OUTPUT_BYTES:
        raise InputError(path, f"larger than {_MAX_OUTPUT_BYTES >> 20} MiB: not one run's output")
    return data.decode("utf-8", errors="replace")


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / RUN_FILE).is_file()


def read_run(path: str | Path) -> EngineRun:
    """Read one run: a run directory (``RUN_FILE``, ``STDOUT_FILE``, ``STDERR_FILE``) or one text file
    holding a run's output (stdout and stderr captured together, e.g. ``> run.log 2>&1``)."""
    p = Path(path)
    if p.is_dir():
        if not is_run_dir(p):
            raise InputError(p, f"no {RUN_FILE}: not a measured run's directory (or the run did not complete)")
        identity = RunIdentity.from_json(parse_json(read_bytes(p / RUN_FILE)), str(p / RUN_FILE))
        text = _text(p / STDOUT_FILE) + "\n" + _text(p / STDERR_FILE)
        route = p / ROUTE_FILE
        return EngineRun(str(p), identity, parse_engine_output(text, str(p)), str(route) if route.is_file() else None)
    return EngineRun(str(p), None, parse_engine_output(_text(p), str(p)), None)


def looks_like_engine_output(path: str | Path) -> bool:
    """Whether ``path`` is a run directory, a directory of them, or a text file with a colibrì ``PROFILE:`` line."""
    p = Path(path)
    if p.is_dir():
        return is_run_dir(p) or any(is_run_dir(c) or (c.is_file() and looks_like_engine_output(c)) for c in p.iterdir())
    if p.suffix in (".jsonl", ".zst", ".json"):
        return False
    try:
        with open(p, "rb") as f:
            head = f.read(1 << 20)
    except OSError:
        return False
    return b"PROFILE: expert-disk" in head or re.search(rb"(?m)^PROF \d", head) is not None


def read_runs(path: str | Path) -> list[EngineRun]:
    """The runs of one argument: a run directory, a directory of run directories (sorted by
    name; directories without ``RUN_FILE`` are runs that did not complete and are skipped), a
    directory of run output files (when it holds no run directories), or one output file."""
    p = Path(path)
    if p.is_dir() and not is_run_dir(p):
        children = sorted(p.iterdir())
        runs = [read_run(c) for c in children if c.is_dir() and is_run_dir(c)]
        if not runs:
            runs = [read_run(c) for c in children if c.is_file() and not c.name.startswith(".") and looks_like_engine_output(c)]
        if not runs:
            raise InputError(p, "no completed engine runs in this directory")
        return runs
    return [read_run(p)]
