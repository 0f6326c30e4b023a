"""What colibrì prints about a run: the counts a ROUTE_TRACE cannot carry.

A ROUTE_TRACE records routing, not acceptance: how many tokens an n-gram verify step committed
is in no line of it. colibrì's own output states the session's totals, and
:func:`read_runtime_output` reads them from a saved copy of it (stdout, or stdout and stderr
together), from these lines:

* ``loaded in ... | layers=<L> experts=<E> | MTP <ACTIVE|absent|...> (draft=<G>)``: the model's
  layer count (an MTP head is layer ``L``) and the speculation depth ``G``;
* ``... (<N> forwards per <T> tokens)``, at the end of the ``speculation:`` line of a text run and
  of the ``N-gram speculation (DRAFT=<G>):`` line of an oracle run: decode forwards (the prefill is
  not one of them) and tokens emitted, exactly;
* ``[PROF] decode forwards: <N> | ... | <x> tok/forward`` (``PROF=1``): the same forwards, and
  the tokens when ``N * x`` rounded to two decimals leaves only one integer;
* ``Matching tokens: <m>/<T>`` (oracle runs, which never stop early): the tokens generated;
* ``STAT <tokens> <tok/s> <hit%> <RSS GB> <prompt tokens> <length limited>`` (serve mode, after
  each answer's end marker): one served turn's tokens, with that turn's ``[PROF] decode
  forwards`` line (stderr, ``PROF=1``) when the output holds one per turn.

Every count found must agree with the others; a file stating none of them is an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from containers.errors import InputError
from containers.jsonfile import read_bytes

_LOADED = re.compile(rb"\| layers=(\d+) experts=(\d+) \| MTP (ACTIVE|absent|[A-Za-z ()-]+?) \(draft=(-?\d+)\)")
_PER = re.compile(rb"\((\d+) forwards per (\d+) tokens\)")
_PROF = re.compile(rb"\[PROF\] decode forwards: (\d+) \|.*\| (\d+\.\d+) tok/forward")
_MATCHING = re.compile(rb"^Matching tokens: (\d+)/(\d+)\s*$", re.M)
_TURN = re.compile(rb"^STAT (\d+) \S+ \S+ \S+ (\d+) (\d+)", re.M)

MAX_OUTPUT_BYTES = 64 << 20
"""Largest runtime output read (the count lines are printed once per run)."""


@dataclass(frozen=True)
class RuntimeCounts:
    """One run's counts as colibrì printed them (None: not printed).

    ``forwards``: decode forwards, the prefill excluded; ``tokens``: tokens emitted;
    ``n_layers``: the model's layers (its MTP head, when active, is layer ``n_layers``);
    ``mtp``: the MTP head drafted; ``draft``: drafts proposed per forward; ``turns``: a serve
    process's ``(decode forwards or None, tokens)`` per turn, in order (empty for one-shot runs).
    """

    source: str
    forwards: int | None = None
    tokens: int | None = None
    n_layers: int | None = None
    mtp: bool | None = None
    draft: int | None = None
    turns: tuple = ()

    def turn(self, i: int) -> RuntimeCounts:
        """The counts of served turn ``i`` alone."""
        forwards, tokens = self.turns[i]
        return RuntimeCounts(f"{self.source} (turn {i + 1})", forwards, tokens, self.n_layers, self.mtp, self.draft)

    def to_json(self) -> dict:
        fields = (("runtime_output", Path(self.source).name), ("forwards", self.forwards), ("tokens", self.tokens),
                  ("n_layers", self.n_layers), ("mtp", self.mtp), ("draft", self.draft))
        return {k: v for k, v in fields if v is not None}


def _agree(path: Path, what: str, values: list[tuple[int, str]]) -> int | None:
    """The one value of ``what`` the lines state (None if none); an error naming both lines if two differ."""
    if not values:
        return None
    first, line = values[0]
    for v, other in values[1:]:
        if v != first:
            raise InputError(path, f"says {first} {what} ({line!r}) and {v} ({other!r})")
    return first


def _prof_tokens(forwards: int, per: str) -> int | None:
    """The token count ``T`` with ``round(T / forwards, 2) == per``, when exactly one integer fits."""
    if forwards <= 0:
        return None
    x = float(per)
    lo, hi = int((x - 0.005) * forwards) - 1, int((x + 0.005) * forwards) + 1
    fits = [t for t in range(max(lo, 0), hi + 1) if f"{t / forwards:.2f}" == per]
    return fits[0] if len(fits) == 1 else None


def read_runtime_output(path: Path) -> RuntimeCounts:
    """Read the counts of one colibrì run from its saved output (see the module doc).

    Parameters
    ----------
    path : Path
        colibrì's stdout (or stdout and stderr together) of one run, plain or zstd, at most
        ``MAX_OUTPUT_BYTES``.

    Returns
    -------
    RuntimeCounts
        The counts the output states; an :class:`InputError` naming the file when two lines
        disagree or none states forwards or tokens.
    """
    try:
        size = Path(path).stat().st_size
    except OSError as exc:
        raise InputError(path, exc.strerror or str(exc)) from None
    if size > MAX_OUTPUT_BYTES:
        raise InputError(path, f"{size:,} bytes: too large for a colibrì run's output (at most {MAX_OUTPUT_BYTES:,})")
    data = read_bytes(path)
    text = lambda m: m.group(0).decode(errors="replace").strip()[:120]
    loaded = [m for m in _LOADED.finditer(data)]
    n_layers = _agree(path, "layers", [(int(m.group(1)), text(m)) for m in loaded])
    draft = _agree(path, "drafts per forward", [(int(m.group(4)), text(m)) for m in loaded])
    mtp = None
    if loaded:
        mtp = loaded[-1].group(3) == b"ACTIVE" and (draft or 0) > 0
    draft = draft if draft is None or draft >= 0 else None
    served = [int(m.group(1)) for m in _TURN.finditer(data)]
    if served:
        per_turn = [int(m.group(1)) for m in _PROF.finditer(data)]
        fw = per_turn if len(per_turn) == len(served) else [None] * len(served)
        turns = tuple(zip(fw, served))
        total_fw = sum(per_turn) if len(per_turn) == len(served) else None
        return RuntimeCounts(str(path), total_fw, sum(served), n_layers, mtp, draft, turns)
    forwards, tokens = [], []
    for m in _PER.finditer(data):
        forwards.append((int(m.group(1)), text(m)))
        tokens.append((int(m.group(2)), text(m)))
    for m in _PROF.finditer(data):
        n = int(m.group(1))
        forwards.append((n, text(m)))
        t = _prof_tokens(n, m.group(2).decode())
        if t is not None:
            tokens.append((t, text(m)))
    for m in _MATCHING.finditer(data):
        tokens.append((int(m.group(2)), text(m)))
    counts = RuntimeCounts(str(path), _agree(path, "decode forwards", forwards), _agree(path, "tokens", tokens),
                           n_layers, mtp, draft)
    if counts.forwards is None and counts.tokens is None:
        raise InputError(path, "no run counts found: expected colibrì's '(N forwards per T tokens)', "
                               "'[PROF] decode forwards: N' or 'Matching tokens: m/T' line")
    return counts
