"""What a ROUTE_TRACE's calls mean: forwards, an MTP head's calls, positions, and each forward's counts.

A new forward starts where the layer goes down, or repeats on a layer that is not an MTP head's,
so a model with one MoE layer has one forward per call. An MTP (multi-token prediction) head is a
layer past the main model's (layer ``num_hidden_layers``) that colibrì calls between forwards:
after a forward, one *absorb* call whose rows are the drafts it accepted (after the prefill, the
prompt's pairs), then one *draft* call of one row per draft of the next step. Those calls stay in
the forward they follow; where they write a row again, the last write keeps its position and the
earlier writes are placed after the forward's positions. The head's layer is the geometry's, the
runtime output's, or the trace's top layer when its calls show as the head's
(:func:`mtp_layers`). The first forward is the prompt's prefill (commits its first generated
token: 1); later forwards of one row are decode steps, wider ones speculative verify steps;
evaluated positions are the main model's rows. An MTP verify step commits 1 + its absorbed drafts;
an n-gram verify step's acceptance is in no line: it is recorded as committing 1 (the minimum) and
marked assumed, unless colibrì's output of the run is given (:mod:`relayout.traces.runtime_output`): its
decode forwards must be the trace's and its tokens become the session's. A file written by a serve
process holds several prompts: each prompt's prefill is a forward wider than a decode step
(``1 + G`` rows, ``G`` drafts a step, when ``G`` is known), and its turn's counts come from the
output's served turns (:func:`prompt_starts`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from containers.errors import InputError

from .sessions import KIND, Limits, SessionRows, session_from_rows

def joined_session(path: Path, name: str, parts: list[SessionRows], runtime) -> SessionRows:
    """The prompts of one file, counted each on its own, as one session (made ``runtime``'s
    counts when given: a run's output that counts every prompt together)."""
    offsets = np.cumsum([0] + [len(p.fwd_kind) for p in parts[:-1]])
    cat = lambda key: np.concatenate([getattr(p, key) for p in parts])
    kinds, evaluated, committed = cat("fwd_kind"), cat("fwd_evaluated"), cat("fwd_committed")
    assumed = np.concatenate([p.fwd_assumed if p.fwd_assumed is not None else np.zeros(len(p.fwd_kind), bool) for p in parts])
    counts = {k: v for k, v in (parts[0].counts or {}).items() if k in ("mtp_layers", "drafts_per_forward")}
    counts["prompts"] = len(parts)
    if runtime is not None:
        _reconcile(path, name, kinds, evaluated, committed, assumed, runtime)
        counts.update(runtime.to_json())
    elif any(p.counts and "tokens" in p.counts for p in parts):
        counts["runtime_output"] = parts[0].counts["runtime_output"].rsplit(" (turn", 1)[0]
        counts["tokens"] = int(committed.sum())
    return SessionRows(name, np.concatenate([p.forward + o for p, o in zip(parts, offsets)]), cat("layer"), cat("position"),
                       cat("experts"), cat("gates"), kinds, evaluated, committed, assumed, counts)


def route_session(path: Path, name: str, forward, layers, rows, experts, gates, is_mtp, *, c_start, c_lines, runtime,
                  structure) -> SessionRows:
    """One session's rows and counts (:func:`_route_counts`), made ``runtime``'s counts when given;
    ``structure``: a runtime output read for its draft depth only."""
    if runtime is not None:
        structure = runtime
    elif structure is not None:
        structure = replace(structure, forwards=None, tokens=None, turns=())
    evaluated, kinds, committed, assumed, drafts = _route_counts(forward, rows, is_mtp, c_start, c_lines, structure)
    counts = {}
    if is_mtp.any():
        counts["mtp_layers"] = sorted(int(x) for x in np.unique(layers[is_mtp]))
        counts["drafts_per_forward"] = drafts
    if runtime is not None:
        _reconcile(path, name, kinds, evaluated, committed, assumed, runtime)
        counts.update(runtime.to_json())
    elif structure is not None:
        counts["draft_depth_from"] = Path(structure.source).name
    position = _mtp_positions(forward, layers, rows, is_mtp, evaluated)
    session = session_from_rows(name, forward, layers, position, experts, gates, committed=committed,
                                evaluated=evaluated, kinds=kinds, assumed=assumed)
    session.counts = counts or None
    return session


def prompt_starts(forward, rows, is_mtp, c_start, c_lines, runtime, split: bool) -> list[int]:
    """The forwards where a ROUTE_TRACE holding several prompts (a serve process's) starts a new
    one: forward 0 and every forward wider than the widest decode step, ``1 + G`` rows with ``G``
    drafts per forward, after one that is not (the chunks of a long prompt follow each other).
    ``G``: the runtime output's; else the MTP head's drafts after the first prefill; else, when
    ``split``, 0 (a run without drafts, as an n-gram drafting run is unless its output is given);
    else unknown, and the file is one prompt."""
    F = int(forward[-1]) + 1
    S = np.zeros(F, dtype=np.int64)
    np.maximum.at(S, forward[~is_mtp], rows[~is_mtp].astype(np.int64) + 1)
    if runtime is not None and runtime.draft is not None:
        G = max(int(runtime.draft), 0)
    elif is_mtp.any():
        head = is_mtp[c_start]
        G = int((head & (forward[c_start] == 0)).sum()) - int(S[0] >= 2)
    elif split:
        G = 0
    else:
        return [0]
    wide = S > 1 + max(G, 0)
    return [0] + [int(f) for f in np.flatnonzero(wide[1:] & ~wide[:-1]) + 1]


def split_every(s: SessionRows, tokens: int) -> list[SessionRows]:
    """``s`` cut into sessions of about ``tokens`` committed tokens each, at forward boundaries
    (a piece ends with the forward that reaches its share)."""
    cum = np.cumsum(s.fwd_committed)
    ends = np.flatnonzero(np.diff(cum // tokens, prepend=0) > 0) + 1
    bounds = [0] + [int(e) for e in ends if 0 < e < len(cum)] + [len(cum)]
    bounds = sorted(set(bounds))
    out = []
    for j, (f0, f1) in enumerate(zip(bounds[:-1], bounds[1:])):
        r0, r1 = np.searchsorted(s.forward, [f0, f1])
        part = slice(r0, r1)
        piece = SessionRows(f"{s.name}#{j + 1}", s.forward[part] - f0, s.layer[part], s.position[part], s.experts[part],
                            s.gates[part], s.fwd_kind[f0:f1], s.fwd_evaluated[f0:f1], s.fwd_committed[f0:f1],
                            None if s.fwd_assumed is None else s.fwd_assumed[f0:f1],
                            {**(s.counts or {}), "split_from": s.name, "piece": f"{j + 1} of {len(bounds) - 1}"})
        out.append(piece)
    return out


def mtp_layers(limits: Limits, runtime, c_first: np.ndarray, c_last: np.ndarray, c_lines: np.ndarray) -> frozenset:
    """The layers of a session's MTP head: the geometry's, the runtime output's (layer ``n_layers``
    when it drafted with MTP), and the session's top layer when two calls in a row route only it,
    or a call routing only it has another number of rows than the call of a lower layer before it
    (a main-model forward routes every layer once, all its rows in each; the head's absorb and
    draft calls do neither)."""
    mtp = set(limits.mtp_layers)
    if runtime is not None and runtime.mtp and runtime.n_layers is not None:
        mtp.add(int(runtime.n_layers))
    top = int(c_last.max())
    if int(c_first.min()) < top:
        only_top = (c_first == top) & (c_last == top)
        after_lower = only_top[1:] & (c_last[:-1] < top) & (c_first[:-1] == c_last[:-1]) & (c_lines[1:] != c_lines[:-1])
        if (only_top[1:] & only_top[:-1]).any() or after_lower.any():
            mtp.add(top)
    return frozenset(mtp)


def route_forwards(c_first: np.ndarray, c_last: np.ndarray, n_lines: np.ndarray, mtp: frozenset) -> np.ndarray:
    """Forward index per line. A call starts a forward where the layer goes down, or repeats on a
    layer that is not an MTP head's (a model routing one layer): colibrì's ``route_pairs.py`` rule,
    which keeps an MTP head's absorb and draft calls in the forward they follow."""
    new = np.zeros(len(c_first), dtype=bool)
    new[1:] = (c_first[1:] < c_last[:-1]) | ((c_first[1:] == c_last[:-1]) & ~np.isin(c_first[1:], list(mtp)))
    return np.repeat(np.cumsum(new), n_lines)


def _mtp_positions(forward: np.ndarray, layers: np.ndarray, rows: np.ndarray, is_mtp: np.ndarray,
                   evaluated: np.ndarray) -> np.ndarray:
    """Positions of every line: its row, except an MTP head's row that a later call of the same
    forward writes again (colibrì's ``route_pairs.py`` keeps the last write of a (forward, row,
    layer)): those follow the forward's positions (from ``max(evaluated, rows)`` on, in file
    order), so they are kept but pair with no main-model row."""
    position = rows.astype(np.int64)
    sel = np.flatnonzero(is_mtp)
    if not len(sel):
        return position
    f, la, r = forward[sel], layers[sel].astype(np.int64), position[sel]
    order = np.lexsort((sel, r, la, f))
    so = sel[order]
    rewritten = np.zeros(len(so), dtype=bool)
    rewritten[:-1] = (f[order][1:] == f[order][:-1]) & (la[order][1:] == la[order][:-1]) & (r[order][1:] == r[order][:-1])
    if not rewritten.any():
        return position
    top = evaluated.astype(np.int64).copy()
    np.maximum.at(top, f, r + 1)
    moved = np.sort(so[rewritten])
    mf, ml = forward[moved], layers[moved].astype(np.int64)
    starts = np.flatnonzero(np.concatenate([[True], (mf[1:] != mf[:-1]) | (ml[1:] != ml[:-1])]))
    ordinal = np.arange(len(moved)) - np.repeat(starts, np.diff(np.append(starts, len(moved))))
    position[moved] = top[mf] + ordinal
    return position


def _route_counts(forward: np.ndarray, rows: np.ndarray, is_mtp: np.ndarray, c_start: np.ndarray, c_lines: np.ndarray,
                  runtime):
    """Per forward of one session: evaluated positions, kind, committed tokens, whether the count
    is assumed; and the drafts per forward the MTP reading used (None without an MTP head).

    Evaluated: the main model's rows (an MTP head's are not positions of the forward). The prefill
    is the first forward, or its first forwards when colibrì prefilled in chunks
    (:func:`_prefill_forwards`); later forwards are decode (one row) or verify. Committed: 1 for
    the prefill (its first generated token; earlier chunks 0), a decode and, at least, a verify;
    an MTP verify commits 1 + the rows of the head's absorb call that follows it (the accepted
    drafts; colibrì absorbs them before drafting again, one row a draft, ``G`` drafts a forward).
    An n-gram verify's acceptance is in no line: assumed.
    """
    F = int(forward[-1]) + 1
    main = ~is_mtp
    S = np.zeros(F, dtype=np.int64)
    np.maximum.at(S, forward[main], rows[main].astype(np.int64) + 1)
    only_head = np.bincount(forward[main], minlength=F) == 0
    if only_head.any():
        S_all = np.zeros(F, dtype=np.int64)
        np.maximum.at(S_all, forward, rows.astype(np.int64) + 1)
        S[only_head] = S_all[only_head]
    kinds = np.where(S == 1, KIND["decode"], KIND["verify"]).astype(np.int8)
    n_prefill = _prefill_forwards(S, runtime)
    kinds[:n_prefill] = KIND["prefill"]
    c_fwd, c_head = forward[c_start], is_mtp[c_start]
    has_head = bool(c_head.any())
    committed = np.ones(F, dtype=np.int64)
    committed[:n_prefill - 1] = 0
    assumed = kinds == KIND["verify"]
    G = None
    if has_head:
        m = np.bincount(c_fwd[c_head], minlength=F)
        if runtime is not None and runtime.draft:
            G = int(runtime.draft)
        else:   # the widest verify step, or the drafts after the prefill's absorb (when drafting is on)
            G = max(1, int(S[n_prefill:].max()) - 1 if F > n_prefill else 1, int(m[0]) - int(S[0] >= 2))
        head_calls = np.flatnonzero(c_head)
        firsts = head_calls[np.unique(c_fwd[head_calls], return_index=True)[1]]
        r1 = np.zeros(F, dtype=np.int64)
        r1[c_fwd[firsts]] = c_lines[firsts]
        S_next = np.append(S[1:], 0)
        has_next = np.arange(F) < F - 1
        # drafts precede a verify; a one-row step after them is the last one of a run that writes its
        # final token to the KV cache (its drafts are cut to 0 as no token is left to generate)
        last_step = np.arange(F) == F - 2
        drafts = np.where(has_next & ((S_next >= 2) | (m > 1) | last_step), np.minimum(m, G), 0)
        extra = m - drafts
        k = np.where(m == 0, 0, np.where(r1 >= 2, r1, (extra == 1).astype(np.int64)))
        understood = ((m == 0) | (r1 >= 2) | (extra <= 1)) & (k <= S - 1)
        verify = kinds == KIND["verify"]
        committed[verify] = 1 + k[verify]
        assumed = verify & ~understood
        committed[assumed] = 1
    return S, kinds, committed, assumed, G


MAX_VERIFY_ROWS = 64
"""Rows of colibrì's widest verify step (1 + at most 63 drafts)."""


def _prefill_forwards(S: np.ndarray, runtime) -> int:
    """How many leading forwards of a session (rows per forward ``S``) are its prompt's prefill.

    colibrì counts decode forwards only, so with its count the rest are the prefill (when they
    have a chunked prefill's shape; otherwise the output is not this session's). Without it:
    the first forward, or, where colibrì cut a long prompt into chunks (``COLI_PREFILL_CHUNK``):
    two or more leading forwards of the first one's rows, wider than any verify step, then the
    prompt's remainder when it is wider than one row (a one-row remainder reads as a decode step).
    """
    F = len(S)
    if runtime is not None and runtime.forwards is not None and 1 <= F - runtime.forwards:
        n = F - runtime.forwards
        if n == 1 or (S[0] > 1 and (S[:n - 1] == S[0]).all() and S[n - 1] <= S[0]):
            return n                    # chunks of one width, then the remainder
    if F < 2 or S[0] <= MAX_VERIFY_ROWS or S[1] != S[0]:
        return 1
    run = int(np.argmin(np.append(S, -1) == S[0]))
    return run + 1 if run < F and S[run] > 1 else run


def _reconcile(path: Path, name: str, kinds: np.ndarray, evaluated: np.ndarray, committed: np.ndarray,
               assumed: np.ndarray, runtime) -> None:
    """Make a session's counts the runtime output's (in place), or refuse an output that does not
    belong to the trace.

    colibrì counts decode forwards (the prefill excluded) and tokens emitted. Tokens the trace
    cannot place (n-gram verify steps' accepted drafts) go to the verify forwards in proportion to
    their drafts (largest remainder; each at most its drafts), which stay marked assumed unless
    the share is forced (none accepted, or all). One token fewer than the trace's count is the
    last forward's next token, not emitted (the session stopped at its token limit or at EOS, or
    the forward only wrote the KV cache).
    """
    where = runtime.source
    decode_phase = int((kinds != KIND["prefill"]).sum())
    if runtime.forwards is not None and runtime.forwards != decode_phase:
        raise InputError(where, f"reports {runtime.forwards} decode forwards; {path} has {decode_phase} after its "
                                f"prefill: not this trace's run?")
    if runtime.tokens is None:
        return
    free = np.flatnonzero(assumed)
    room = evaluated[free] - committed[free]
    need = runtime.tokens - int(committed.sum())
    if need == -1 and committed[-1] >= 1:
        committed[-1] -= 1
        return
    if not 0 <= need <= int(room.sum()):
        lo, hi = int(committed.sum()) - 1, int(committed.sum() + room.sum())
        raise InputError(where, f"reports {runtime.tokens} tokens; {path}'s forwards commit {lo}..{hi}: not this trace's run?")
    if need and len(free):
        share = need * room / room.sum()
        add = np.floor(share).astype(np.int64)
        rest = need - int(add.sum())
        if rest:
            add[np.argsort(-(share - add), kind="stable")[:rest]] += 1
        committed[free] += add
    if need == 0 or need == int(room.sum()):
        assumed[free] = False
