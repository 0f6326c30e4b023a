"""Per-layer expert orderings that keep co-activated experts adjacent.

**Objective.** For a token, the experts it needs at a layer occupy some positions of the layer's
order; they form a number of separate contiguous *runs*. For a set S in an order,
``runs(S) = |S| - #{adjacent positions (p, p+1) both in S}``, so over training rows

    mean runs per token = mean |S| - sum_i C[o_i, o_{i+1}] / N

with C the co-activation count matrix. Minimising runs is therefore exactly maximising the
co-activation weight between neighbours: a maximum-weight Hamiltonian path. The optimiser:

1. Louvain communities (python-louvain) on the co-activation graph, resolution and seed given;
2. communities chained greedily by the weight between them, each ordered internally by its
   Fiedler vector (spectral seriation);
3. local search on the whole path: 2-opt segment reversals and single-expert relocations, each
   move's gain computed exactly in O(1) and all moves scored at once with numpy.

Baselines: ``stock`` (the source's physical order), ``heat``, ``random`` and
``greedy-modularity`` (networkx greedy modularity communities on raw counts, greedy chain inside:
the existing tool's method). Experts never seen in training go last, by heat (ties by id).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from .coactivation import coactivation_graph, heat_of, pair_counts


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

    Alternates the best 2-opt reversal and the best single relocation until neither gains.
    """
    o = np.array(order, dtype=np.int64)
    n = len(o)
    if n < 3:
        return o
    C = C.astype(np.float64)
    for _ in range(max_moves):
        W = C[np.ix_(o, o)]
        # 2-opt: reverse o[i..j]
        edge = np.concatenate([np.diag(W, 1), [0.0]])            # edge[i] = W[i, i+1]
        prev = np.zeros((n, n))
        prev[1:, :] = W[:-1, :]                                   # W[i-1, j]
        nxt = np.zeros((n, n))
        nxt[:, :-1] = W[:, 1:]                                    # W[i, j+1]
        e_prev = np.concatenate([[0.0], edge[:-1]])               # W[i-1, i]
        gain2 = prev - e_prev[:, None] + nxt - edge[None, :]
        gain2[np.tril_indices(n)] = -np.inf
        i2, j2 = np.unravel_index(np.argmax(gain2), gain2.shape)
        best2 = gain2[i2, j2]
        # relocation: take o[i] out, insert it between positions q and q+1 of the original path
        left = np.concatenate([[0.0], edge[:-1]])
        right = edge.copy()
        bridge = np.zeros(n)
        bridge[1:-1] = W[np.arange(0, n - 2), np.arange(2, n)]
        loss = left + right - bridge                               # weight lost by removing o[i]
        ins = np.zeros((n, n + 1))                                 # slot q: between q-1 and q
        ins[:, 0] = W[:, 0]
        ins[:, n] = W[:, n - 1]
        ins[:, 1:n] = W[:, :-1] + W[:, 1:] - edge[None, :-1]
        gain1 = ins - loss[:, None]
        idx = np.arange(n)
        gain1[idx, idx] = -np.inf
        gain1[idx, idx + 1] = -np.inf
        i1, q1 = np.unravel_index(np.argmax(gain1), gain1.shape)
        best1 = gain1[i1, q1]
        if max(best1, best2) <= 1e-9:
            break
        if best2 >= best1:
            o[i2 : j2 + 1] = o[i2 : j2 + 1][::-1].copy()
        else:
            x = o[i1]
            rest = np.delete(o, i1)
            q = q1 if q1 < i1 else q1 - 1
            o = np.insert(rest, q, x)
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


def louvain_order(experts: np.ndarray, n_experts: int, resolution: float = 1.0, seed: int = 0,
                  weight: str = "count", min_support: int = 1) -> LayerOrder:
    """Louvain communities, spectral order inside, greedy chain between, then local search."""
    import community as community_louvain

    heat = heat_of(experts, n_experts)
    C = pair_counts(experts, n_experts)
    G = coactivation_graph(experts, n_experts, weight, min_support)
    connected = [e for e in range(n_experts) if G.degree(e) > 0]
    if not connected:
        return LayerOrder(_unseen_last([], heat), "louvain", [], None)
    H = G.subgraph(connected).copy()
    part = community_louvain.best_partition(H, weight="weight", resolution=resolution, random_state=seed)
    modularity = community_louvain.modularity(part, H, weight="weight")
    groups: dict[int, list[int]] = {}
    for e in sorted(part):
        groups.setdefault(part[e], []).append(e)
    comms = [fiedler_order(g, C, heat) for g in groups.values()]
    chain = [e for g in _chain_groups(comms, C, heat) for e in g]
    chain = improve_path(np.array(chain), C).tolist()
    return LayerOrder(_unseen_last(chain, heat), "louvain", [sorted(g) for g in comms], float(modularity))


def greedy_modularity_order(experts: np.ndarray, n_experts: int) -> LayerOrder:
    """The existing tool's method: greedy modularity on raw counts, greedy chain inside each."""
    heat = heat_of(experts, n_experts)
    C = pair_counts(experts, n_experts)
    G = coactivation_graph(experts, n_experts, "count", 1)
    H = G.subgraph([e for e in range(n_experts) if G.degree(e) > 0]).copy()
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
    modularity = nx.community.modularity(H, comms, weight="weight")
    return LayerOrder(_unseen_last(order, heat), "greedy-modularity", comms, float(modularity))


def heat_order(experts: np.ndarray, n_experts: int) -> LayerOrder:
    heat = heat_of(experts, n_experts)
    return LayerOrder(np.array(sorted(range(n_experts), key=lambda e: (-heat[e], e))), "heat")


def random_order(n_experts: int, seed: int, layer: int) -> LayerOrder:
    rng = np.random.default_rng([seed, layer])
    return LayerOrder(rng.permutation(n_experts), "random")
