"""Per-layer expert orderings that keep co-activated experts adjacent.

**Objective.** For a token, the experts it needs at a layer occupy some positions of the layer's
order; they form a number of separate contiguous *runs*. For a set S in an order,
``runs(S) = |S| - #{adjacent positions (p, p+1) both in S}``, so over training rows

    mean runs per token = mean |S| - sum_i C[o_i, o_{i+1}] / N

with C the co-activation count matrix. Minimising runs is therefore exactly maximising the
co-activation weight between neighbours: a maximum-weight Hamiltonian path. The optimiser:

1. Louvain communities (:mod:`relayout.planning.louvain`, on the dense weight matrix) of the
   co-activation graph, resolution and seed given;
2. communities chained greedily by the weight between them, each ordered internally by its
   Fiedler vector (spectral seriation);
3. local search on the whole path: 2-opt segment reversals and single-expert relocations, each
   move's gain computed exactly in O(1) and all O(n^2) moves scored in one compiled loop.

Baselines: ``stock`` (the source's physical order), ``heat``, ``random`` and
``greedy-modularity`` (networkx greedy modularity communities on raw counts, greedy chain inside:
the existing tool's method). Experts never seen in training go last, by heat (ties by id).

Every method reads a layer's :class:`~relayout.planning.coactivation.LayerCounts` (pair counts, heat,
rows), never the rows themselves, so a plan can learn from counts pooled over many trace files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import numpy as np
from numba import njit

from replay.model.jit import LOOP

from relayout.planning.coactivation import LayerCounts, coactivation_graph, weight_matrix
from relayout.planning.louvain import louvain_partition, modularity


def runs_per_token(experts: np.ndarray, order: np.ndarray) -> float:
    """Mean number of contiguous runs the selected experts of each row form in ``order``.

    ``experts`` [N, k] (-1 padding); ``order`` lists expert ids from first to last position.
    """
    if not len(experts):
        return 0.0
    position = np.empty(len(order), dtype=np.int64)
    position[np.asarray(order)] = np.arange(len(order))
    valid = experts >= 0
    P = np.where(valid, position[np.where(valid, experts, 0)], -2)
    P.sort(axis=1)
    starts = (P >= 0) & np.concatenate([np.ones((len(P), 1), bool), (P[:, 1:] - P[:, :-1]) != 1], axis=1)
    return float(starts.sum(axis=1).mean())


def path_weight(order: np.ndarray, C: np.ndarray) -> float:
    o = np.asarray(order)
    return float(C[o[:-1], o[1:]].sum())


def improve_path(order: np.ndarray, C: np.ndarray, max_moves: int = 20000) -> np.ndarray:
    """Local search maximising the neighbour weight of ``order`` under matrix ``C``.

    Each step scores every 2-opt reversal (reverse ``o[i..j]``) and every single relocation
    (take ``o[i]`` out, insert it between two neighbours), each gain exact in O(1), and makes
    the best move (the first in (i, j) order on ties, a reversal when the two kinds tie) until
    no move gains more than 1e-9 or ``max_moves`` were made. O(n^2) per move, compiled.
    """
    o = np.array(order, dtype=np.int64)
    if len(o) < 3:
        return o
    return _improve_path(o, np.ascontiguousarray(C, dtype=np.float64), max_moves)


@njit(**LOOP)
def _improve_path(o, C, max_moves):  # pragma: no cover - compiled
    n = len(o)
    edge = np.zeros(n)                 # edge[p] = weight between positions p and p+1 (0 at the end)
    for _ in range(max_moves):
        for p in range(n - 1):
            edge[p] = C[o[p], o[p + 1]]
        edge[n - 1] = 0.0
        # 2-opt: reversing o[i..j] replaces edges (i-1, i) and (j, j+1) by (i-1, j) and (i, j+1)
        best2, i2, j2 = -np.inf, 0, 0
        for i in range(n):
            before = edge[i - 1] if i > 0 else 0.0
            for j in range(i + 1, n):
                prev = C[o[i - 1], o[j]] if i > 0 else 0.0
                nxt = C[o[i], o[j + 1]] if j < n - 1 else 0.0
                gain = prev - before + nxt - edge[j]
                if gain > best2:
                    best2, i2, j2 = gain, i, j
        # relocation: o[i] out (its two edges lost, its neighbours bridged), in at slot q (between q-1 and q)
        best1, i1, q1 = -np.inf, 0, 0
        for i in range(n):
            left = edge[i - 1] if i > 0 else 0.0
            bridge = C[o[i - 1], o[i + 1]] if 0 < i < n - 1 else 0.0
            loss = left + edge[i] - bridge
            for q in range(n + 1):
                if q == i or q == i + 1:
                    continue
                if q == 0:
                    ins = C[o[i], o[0]]
                elif q == n:
                    ins = C[o[i], o[n - 1]]
                else:
                    ins = C[o[i], o[q - 1]] + C[o[i], o[q]] - edge[q - 1]
                gain = ins - loss
                if gain > best1:
                    best1, i1, q1 = gain, i, q
        if max(best1, best2) <= 1e-9:
            break
        if best2 >= best1:
            o[i2:j2 + 1] = o[i2:j2 + 1][::-1].copy()
        else:
            x = o[i1]
            q = q1 if q1 < i1 else q1 - 1
            rest = np.concatenate((o[:i1], o[i1 + 1:]))
            o = np.concatenate((rest[:q], np.array([x]), rest[q:]))
    return o


def fiedler_order(nodes: list[int], C: np.ndarray, heat: np.ndarray) -> list[int]:
    """Spectral seriation of ``nodes`` by the Fiedler vector of their weighted Laplacian."""
    if len(nodes) <= 2:
        return sorted(nodes, key=lambda e: (-heat[e], e))
    sub = C[np.ix_(nodes, nodes)].astype(np.float64)
    lap = np.diag(sub.sum(axis=1)) - sub
    vals, vecs = np.linalg.eigh(lap)
    f = vecs[:, 1]
    if f[np.argmax(np.abs(f))] < 0:
        f = -f
    return [nodes[i] for i in np.lexsort((np.asarray(nodes), np.round(f, 12)))]


def _chain_groups(groups: list[list[int]], C: np.ndarray, heat: np.ndarray) -> list[list[int]]:
    """Order groups greedily: start at the hottest, append the group most tied to the last one."""
    if not groups:
        return []
    G = np.array([[C[np.ix_(a, b)].sum() for b in groups] for a in groups], dtype=np.float64)
    np.fill_diagonal(G, -1)
    gheat = np.array([heat[g].sum() for g in groups])
    left = set(range(len(groups)))
    cur = int(np.argmax(gheat))
    chain = [cur]
    left.remove(cur)
    while left:
        cand = sorted(left, key=lambda j: (-G[cur, j], -gheat[j], j))
        cur = cand[0]
        chain.append(cur)
        left.remove(cur)
    return [groups[i] for i in chain]


@dataclass
class LayerOrder:
    """The order chosen for one layer and what it was built from."""

    order: np.ndarray
    method: str
    communities: list[list[int]] = field(default_factory=list)
    modularity: float | None = None


def _unseen_last(order_seen: list[int], heat: np.ndarray) -> np.ndarray:
    seen = set(order_seen)
    rest = sorted((e for e in range(len(heat)) if e not in seen), key=lambda e: (-heat[e], e))
    return np.array(list(order_seen) + rest, dtype=np.int64)


def louvain_order(counts: LayerCounts, resolution: float = 1.0, seed: int = 0, weight: str = "count",
                  min_support: int = 1) -> LayerOrder:
    """Louvain communities, spectral order inside, greedy chain between, then local search.

    The recorded modularity is the partition's (resolution 1) on the weighted graph of experts
    with at least one edge.
    """
    heat, C = counts.heat, counts.pairs
    W = weight_matrix(counts, weight, min_support)
    connected = np.flatnonzero(W.sum(axis=1) > 0)
    if not len(connected):
        return LayerOrder(_unseen_last([], heat), "louvain", [], None)
    sub = W[np.ix_(connected, connected)]
    part = louvain_partition(sub, resolution, seed)
    groups = [connected[part == c].tolist() for c in range(int(part.max()) + 1)]
    comms = [fiedler_order(g, C, heat) for g in groups]
    chain = [e for g in _chain_groups(comms, C, heat) for e in g]
    chain = improve_path(np.array(chain), C).tolist()
    return LayerOrder(_unseen_last(chain, heat), "louvain", [sorted(g) for g in comms], modularity(sub, part))


def greedy_modularity_order(counts: LayerCounts) -> LayerOrder:
    """The existing tool's method: greedy modularity on raw counts, greedy chain inside each."""
    heat, C = counts.heat, counts.pairs
    G = coactivation_graph(counts, "count", 1)
    H = G.subgraph([e for e in range(counts.n_experts) if G.degree(e) > 0]).copy()
    if H.number_of_nodes() == 0:
        return LayerOrder(_unseen_last([], heat), "greedy-modularity")
    comms = [sorted(c) for c in nx.community.greedy_modularity_communities(H, weight="weight")]
    comms.sort(key=lambda c: (-heat[c].sum(), c[0]))
    order = []
    for c in comms:
        left = set(c)
        cur = max(c, key=lambda e: (heat[e], -e))
        chain = [cur]
        left.remove(cur)
        while left:
            cur = max(left, key=lambda e: (C[cur, e], heat[e], -e))
            chain.append(cur)
            left.remove(cur)
        order += chain
    q = nx.community.modularity(H, comms, weight="weight")
    return LayerOrder(_unseen_last(order, heat), "greedy-modularity", comms, float(q))


def heat_order(counts: LayerCounts) -> LayerOrder:
    heat = counts.heat
    return LayerOrder(np.array(sorted(range(counts.n_experts), key=lambda e: (-heat[e], e))), "heat")


def random_order(n_experts: int, seed: int, layer: int) -> LayerOrder:
    rng = np.random.default_rng([seed, layer])
    return LayerOrder(rng.permutation(n_experts), "random")
