"""Louvain community detection on a dense, symmetric weight matrix.

The co-activation graph of a layer is small (E experts, E <= a few hundred in today's MoE
models) and dense (most pairs co-occur at least once in 10^4 tokens), so its matrix is the
natural representation: a pass over node ``i`` reads row ``i`` and nothing else, and a level's
aggregation is a sum over blocks of the matrix. Graph libraries pay a dictionary lookup per edge
for the same work; this module does it in compiled loops over the matrix.

**Algorithm** (Blondel et al. 2008). Modularity of a partition of a graph with symmetric weights
``A`` (diagonal = twice a node's self-loop weight, as aggregation produces), degrees
``k_i = sum_j A_ij`` and ``2m = sum_ij A_ij`` is

    Q = sum_c [ in_c / 2m - resolution * (tot_c / 2m)^2 ]

with ``in_c`` the weight of the ordered pairs inside community ``c`` (diagonal included) and
``tot_c`` the sum of its degrees. Moving node ``i`` out of its community and into ``c`` changes
``Q`` by a positive multiple of ``k_i,in(c) - resolution * tot_c * k_i / 2m`` (``k_i,in(c)``: the
weight from ``i`` to the other members of ``c``), so each level:

1. *local moving*: visit the nodes in a random order (fixed by the seed, one permutation per
   level); move each into the neighbouring community with the largest gain when that gain is
   larger than staying; repeat passes until a pass moves nothing;
2. *aggregation*: the communities become the nodes of the next level, with weights summed.

Levels repeat until local moving moves nothing. The result is deterministic for a seed: node
orders come from ``numpy.random.default_rng(seed)``, candidate communities are scanned in node
order and a move needs a strictly larger gain, and every sum runs in a fixed order.

Parameters such as the resolution mean what they mean in networkx's
``louvain_communities`` and python-louvain's ``best_partition``; the partition found may differ
from theirs (their node orders come from other random streams), its modularity is comparable
(``benchmarks/bench_planning.py`` prints the three side by side).

References
----------
.. [1] V. D. Blondel, J.-L. Guillaume, R. Lambiotte, E. Lefebvre, "Fast unfolding of communities
   in large networks", J. Stat. Mech. (2008) P10008.
.. [2] R. Lambiotte, J.-C. Delvenne, M. Barahona, "Laplacian dynamics and multiscale modular
   structure in networks" (2008), for the resolution parameter.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from replay.model.jit import LOOP

_TOLERANCE = 1e-10
"""A move must gain more than this fraction of the node's degree (the largest a gain can be) to be
taken; it stops rounding noise from moving a node back and forth between equally good communities."""


@njit(**LOOP)
def _local_moving(A, degree, two_m, resolution, order, community):  # pragma: no cover - compiled
    """One level's local moving, in place on ``community`` [n]; returns the number of moves."""
    n = A.shape[0]
    total = np.zeros(n)
    for i in range(n):
        total[community[i]] += degree[i]
    links = np.zeros(n)
    moves = 0
    while True:
        moved = 0
        for t in range(n):
            i = order[t]
            home = community[i]
            for j in range(n):
                if j != i:
                    links[community[j]] += A[i, j]
            total[home] -= degree[i]
            scale = resolution * degree[i] / two_m
            best = home
            best_gain = links[home] - scale * total[home]
            margin = _TOLERANCE * degree[i]
            for j in range(n):
                if j == i or A[i, j] <= 0.0:
                    continue
                c = community[j]
                gain = links[c] - scale * total[c]
                if gain > best_gain + margin:
                    best = c
                    best_gain = gain
            total[best] += degree[i]
            community[i] = best
            for j in range(n):
                links[community[j]] = 0.0
            links[home] = 0.0
            if best != home:
                moved += 1
        moves += moved
        if moved == 0:
            return moves


@njit(**LOOP)
def _aggregate(A, community, n_communities):  # pragma: no cover - compiled
    """Weights between communities [K, K]: block sums of ``A`` (diagonal: ordered pairs inside)."""
    n = A.shape[0]
    out = np.zeros((n_communities, n_communities))
    for i in range(n):
        ci = community[i]
        for j in range(n):
            out[ci, community[j]] += A[i, j]
    return out


def _check_weights(W: np.ndarray) -> np.ndarray:
    W = np.ascontiguousarray(W, dtype=np.float64)
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"weights must be a square matrix, got shape {W.shape}")
    if not np.isfinite(W).all() or (W < 0).any():
        raise ValueError("weights must be finite and non-negative")
    if not np.array_equal(W, W.T):
        raise ValueError("weights must be symmetric")
    return W


def louvain_partition(W: np.ndarray, resolution: float = 1.0, seed: int = 0) -> np.ndarray:
    """Community of each node [n] (int64, numbered 0.. by first member) of weights ``W`` [n, n].

    Parameters
    ----------
    W : ndarray [n, n]
        Symmetric non-negative edge weights; ``W[i, j]`` is the weight of edge (i, j), the
        diagonal is ignored (a node's self-loop, if any, does not change who its neighbours are).
    resolution : float
        Above 1 favours smaller communities, below 1 larger ones.
    seed : int
        Fixes the order nodes are visited in; the same inputs and seed give the same partition.

    Returns
    -------
    ndarray [n] of int64
        ``community[i]``; nodes without any edge are communities of their own.

    References
    ----------
    Blondel et al. (2008), see the module docstring.
    """
    W = _check_weights(W).copy()
    np.fill_diagonal(W, 0.0)
    n = len(W)
    member = np.arange(n, dtype=np.int64)
    two_m = float(W.sum())
    if n == 0 or two_m <= 0:
        return member
    rng = np.random.default_rng(seed)
    A = W
    while True:
        level = np.arange(len(A), dtype=np.int64)
        order = rng.permutation(len(A)).astype(np.int64)
        if _local_moving(A, A.sum(axis=1), two_m, float(resolution), order, level) == 0:
            break
        _, level = np.unique(level, return_inverse=True)
        member = level[member]
        A = _aggregate(A, level.astype(np.int64), int(level.max()) + 1)
    # number communities by their first member, so the labels do not depend on the seed's order
    _, first = np.unique(member, return_index=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first)] = np.arange(len(first))
    return rank[member]


def modularity(W: np.ndarray, community: np.ndarray, resolution: float = 1.0) -> float:
    """Modularity of partition ``community`` [n] of weights ``W`` [n, n] (diagonal ignored).

    The same quantity as ``networkx.community.modularity`` of the graph with these edge weights.
    Returns NaN for a graph without edges.
    """
    W = _check_weights(W).copy()
    np.fill_diagonal(W, 0.0)
    two_m = W.sum()
    if two_m <= 0:
        return float("nan")
    community = np.asarray(community, dtype=np.int64)
    K = int(community.max()) + 1
    onehot = np.zeros((len(W), K))
    onehot[np.arange(len(W)), community] = 1.0
    inside = np.einsum("ic,ij,jc->c", onehot, W, onehot)
    total = onehot.T @ W.sum(axis=1)
    return float((inside / two_m - resolution * (total / two_m) ** 2).sum())
