"""colibrì's ``.coli_pairs`` file: the cross-layer pair table ``COUPLE=<file>`` prefetches from.

Text: a header ``COLIPAIRS 1 <n>`` (``n`` the lines that follow), then one line per (layer,
distance, expert): ``<L> <dL> <e> f1:c1 f2:c2 ...``, ``L`` an absolute layer number, ``dL`` 1 or 2
(the target layer is ``L + dL``), each ``f:c`` a target expert and how often it followed ``e``,
at most :data:`PAIR_TARGETS` of them, strongest first. colibrì reads it once at start-up
(``couple_load``) and scores the next layer's experts by summing the counts over a position's
routed experts (``couple_prefetch``).

:func:`write_coli_pairs_lines` writes it (relayout's ``export coli-pairs``,
:func:`relayout.planning.coactivation.write_coli_pairs`, counts the lines);
:func:`read_coli_pairs` reads the one-layer-ahead table a replay needs, strictly: colibrì skips a
line it cannot parse, the model refuses the file, naming the line.
"""

from __future__ import annotations

import functools
import os
import re

import numpy as np

from containers.atomic import atomic_output
from containers.errors import InputError
from containers.jsonfile import read_bytes

PAIR_TARGETS = 16
"""Targets colibrì keeps per (layer, distance, expert) line (``CP_M``)."""

MAX_BYTES = 1 << 30
"""The largest pair file read (a GLM-5.2 table is a few MB)."""

_HEADER = re.compile(r"COLIPAIRS 1 (\d+)\s*\Z")
_PAIR = re.compile(r"(\d+):(\d+)\Z")


def write_coli_pairs_lines(path: str | os.PathLike, lines: list[tuple[int, int, int, list[tuple[int, int]]]]) -> int:
    """Write ``lines`` (``(L, dL, e, [(f, count), ...])``, targets strongest first) as a
    ``.coli_pairs`` file, crash-safely; returns the number of lines."""
    with atomic_output(path, "w") as fh:
        fh.write(f"COLIPAIRS 1 {len(lines)}\n")
        for layer, dl, e, targets in lines:
            fh.write(f"{layer} {dl} {e} " + " ".join(f"{f}:{c}" for f, c in targets) + "\n")
    return len(lines)


def read_coli_pairs(path: str | os.PathLike, layers, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The one-layer-ahead pair table of a ``.coli_pairs`` file, as the replay model's coupled
    source takes it.

    Parameters
    ----------
    path : path of the file.
    layers : the layout's MoE layers (absolute numbers), in order.
    n_experts : experts per layer.

    Returns
    -------
    ``(targets, counts)``, each [len(layers), n_experts, PAIR_TARGETS]: for layout layer ``li``
    and expert ``e``, the experts of layer ``layers[li] + 1`` that follow it (-1 past the last)
    and their counts, as the file lists them. Lines of distance 2, and of a layer whose next
    layer is not the layout's next MoE layer (colibrì skips a dense target), are not kept.

    Raises
    ------
    InputError
        Naming the file and, for a bad line, its number: no ``COLIPAIRS 1`` header, a line count
        that differs from the header's, a line that is not ``L dL e f:c ...`` with whole numbers,
        a distance other than 1 or 2, an expert or target out of range, more than
        :data:`PAIR_TARGETS` targets, a (layer, distance, expert) given twice.
    """
    data = read_bytes(path)
    if len(data) > MAX_BYTES:
        raise InputError(path, f"larger than {MAX_BYTES >> 20} MiB: not a pair table")
    text = data.decode("utf-8", errors="replace").splitlines()
    head = _HEADER.match(text[0]) if text else None
    if not head:
        raise InputError(path, "no 'COLIPAIRS 1 <n>' header: not a colibrì .coli_pairs file")
    body = [line for line in text[1:] if line.strip()]
    if len(body) != int(head[1]):
        raise InputError(path, f"the header announces {head[1]} lines and the file holds {len(body)}")
    layers = [int(x) for x in layers]
    index = {layer: li for li, layer in enumerate(layers)}
    L, E = len(layers), int(n_experts)
    targets = np.full((L, E, PAIR_TARGETS), -1, np.int32)
    counts = np.zeros((L, E, PAIR_TARGETS), np.int32)
    seen = set()
    for n, line in enumerate(text[1:], start=2):
        words = line.split()
        if not words:
            continue
        if len(words) < 4 or not all(w.isdigit() for w in words[:3]):
            raise InputError(path, f"line {n}: expected '<layer> <distance> <expert> <target>:<count> ...'")
        layer, dl, e = (int(w) for w in words[:3])
        pairs = [_PAIR.match(w) for w in words[3:]]
        if not all(pairs):
            raise InputError(path, f"line {n}: targets are '<expert>:<count>' with whole numbers")
        if (dl not in (1, 2) or e >= E or any(int(p[1]) >= E or int(p[2]) >= 2**31 for p in pairs)
                or len(pairs) > PAIR_TARGETS):
            raise InputError(path, f"line {n}: distance 1 or 2, experts below {E}, counts below 2**31, at most "
                                   f"{PAIR_TARGETS} targets")
        if (layer, dl, e) in seen:
            raise InputError(path, f"line {n}: layer {layer} distance {dl} expert {e} is given twice")
        seen.add((layer, dl, e))
        li = index.get(layer)
        if dl != 1 or li is None or li + 1 >= L or layers[li + 1] != layer + 1:
            continue
        for t, p in enumerate(pairs):
            targets[li, e, t], counts[li, e, t] = int(p[1]), int(p[2])
    return targets, counts


def configured_pair_table(config, layout) -> tuple[np.ndarray, np.ndarray] | None:
    """The pair table a configuration's COUPLE names (``config.couple_file``, a
    :class:`replay.model.config.RuntimeConfig`), on ``layout``'s layers
    (:func:`read_coli_pairs`); None when it names none. A file read before and unchanged since
    (same size and modification time) is not parsed again: a validation replays hundreds of runs
    with one table."""
    if not config.couple_file:
        return None
    try:
        st = os.stat(config.couple_file)
    except OSError as exc:
        raise InputError(config.couple_file, f"cannot read the COUPLE file: {exc.strerror or exc}") from None
    targets, counts = _read_once(str(config.couple_file), st.st_size, st.st_mtime_ns,
                                 tuple(int(x) for x in layout.layers), int(layout.n_experts))
    return targets.copy(), counts.copy()


@functools.lru_cache(maxsize=4)
def _read_once(path: str, size: int, mtime_ns: int, layers: tuple, n_experts: int):
    return read_coli_pairs(path, layers, n_experts)
