"""Synthetic routing traces with real structure, deterministic by seed. The generative model, per
routed layer: a skewed base *heat* over experts (Zipf over a random permutation, or a real atlas's
per-layer heat when fitting); *cliques*, groups of about ``top_k`` experts that tend to fire
together; *topics*, each preferring a few cliques per layer, on which a session dwells for a while
before switching (different sessions favour different topics); and *cross-layer coupling*: with
probability ``coupling`` a token keeps following its clique's partner clique at the next layer
instead of drawing a fresh one. A token's experts at a layer are drawn without replacement
(Gumbel top-k) from the base heat plus a boost of strength ``clique_strength`` on its current
clique. :func:`fit_atlas` tunes that strength so the trace's within-layer lift distribution
matches an atlas such as the shipped ``glm-5.2`` (``manifests/atlases/``) and takes its per-layer
heat directly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from containers.errors import InputError
from containers.jsonfile import parse_json, read_shipped, shipped_names
from replay.model.routing import FORWARD_KINDS, RoutingTrace


@dataclass(frozen=True)
class SynthParams:
    """Knobs of the generator (probabilities in [0, 1])."""

    n_topics: int = 8
    clique_size: int = 0            # 0 = top_k
    clique_strength: float = 0.75   # share of a token's selection weight on its clique
    coupling: float = 0.6           # P(next layer follows this layer's clique partner)
    topic_dwell: int = 40           # mean tokens before a session switches topic
    heat_skew: float = 0.9          # Zipf exponent of the base heat


@dataclass(frozen=True)
class Atlas:
    """Per-layer heat and strongest pairs from a co-activation atlas file."""

    path: str
    tokens: int
    k: int
    n_experts: int
    layers: list[int]
    heat: np.ndarray                 # [L, E]
    pairs: list[np.ndarray]          # per layer [P, 4]: i, j, count, lift


def atlas_names() -> list[str]:
    """Names of the co-activation atlases shipped in ``manifests/atlases``."""
    return shipped_names("atlases")


def load_atlas(name_or_path: str | Path) -> Atlas:
    """A co-activation atlas by shipped name (``manifests/atlases``: ``glm-5.2``, ``qwen3-30b-a3b``) or path."""
    text, where = read_shipped("atlases", name_or_path, "co-activation atlas")
    try:
        d = parse_json(text)
        E, k = int(d["n_expert_per_layer"]), int(d["k"])
        layers, heat, pairs = [], [], []
        for i, layer in enumerate(d["layers"]):
            layers.append(int(layer.get("abs_layer", layer.get("layer", i))))
            heat.append(np.asarray(layer["heat"], dtype=np.float64))
            p = np.asarray([q[:4] for q in layer["pairs"]], dtype=np.float64).reshape(-1, 4)
            pairs.append(p)
        tokens = int(d.get("profile_rows", {}).get("decode_rows") or d.get("n_decode_tokens") or 0)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InputError(where, f"not a co-activation atlas ({type(exc).__name__}: {exc})") from None
    if not layers or len({h.shape for h in heat}) != 1 or heat[0].shape != (E,) or k < 1:
        raise InputError(where, "not a co-activation atlas (layers must each hold heat for n_expert_per_layer experts)")
    if not tokens:
        tokens = int(max(h.sum() for h in heat) // k)
    return Atlas(where, tokens, k, E, layers, np.vstack(heat), pairs)


def entropy_bits(counts: np.ndarray) -> np.ndarray:
    """Shannon entropy (bits) of each row of non-negative counts."""
    p = counts / np.maximum(counts.sum(axis=-1, keepdims=True), 1e-300)
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.nansum(np.where(p > 0, p * np.log2(p), 0.0), axis=-1)


def atlas_style_lifts(experts: np.ndarray, n_experts: int, min_count: int = 5, min_lift: float = 1.5, top: int = 2000) -> np.ndarray:
    """Lifts of the pairs an atlas would list for one layer's rows [N, k]."""
    from relayout.planning.coactivation import pair_counts

    N = experts.shape[0]
    heat = np.bincount(experts[experts >= 0].ravel(), minlength=n_experts).astype(np.float64)
    C = pair_counts(experts, n_experts)
    iu = np.triu_indices(n_experts, 1)
    cnt = C[iu]
    with np.errstate(divide="ignore", invalid="ignore"):
        lift = cnt * N / (heat[iu[0]] * heat[iu[1]])
    keep = (cnt >= min_count) & (lift >= min_lift)
    cnt, lift = cnt[keep], lift[keep]
    order = np.argsort(-cnt, kind="stable")[:top]
    return lift[order]


def synth_trace(
    layers: list[int],
    n_experts: int,
    top_k: int,
    tokens: int,
    sessions: int,
    seed: int = 0,
    params: SynthParams = SynthParams(),
    base_heat: np.ndarray | None = None,
    *,
    geometry: str = "inferred",
) -> RoutingTrace:
    """Generate ``tokens`` decode tokens split over ``sessions`` sessions.

    Parameters
    ----------
    layers : list of int
        The routed layers (absolute numbers).
    n_experts, top_k : int
        Experts per layer, and selections per row.
    tokens, sessions : int
        Decode tokens in all, and sessions they are split over (at least one token each).
    seed : int
        The generator's seed: the same arguments give the same trace.
    params : SynthParams
        The generative model's knobs (see the module doc).
    base_heat : ndarray, optional
        Per-layer heat ``[L, E]`` to draw from instead of the Zipf base.
    geometry : str
        The geometry's name (recorded in the trace).

    Returns
    -------
    RoutingTrace
        One decode forward per token, one row per (forward, layer).
    """
    if tokens < sessions or sessions < 1:
        raise InputError(None, "need at least one token per session and at least one session")
    if top_k > n_experts:
        raise InputError(None, "top-k exceeds the number of experts")
    rng = np.random.default_rng(seed)
    L, E, k = len(layers), n_experts, top_k
    m = params.clique_size or k
    n_cliques = max(1, E // m)
    if base_heat is None:
        heat = np.vstack([1.0 / (1.0 + rng.permutation(E)) ** params.heat_skew for _ in range(L)])
    else:
        heat = np.asarray(base_heat, dtype=np.float64) + 0.5
    heat = heat / heat.sum(axis=1, keepdims=True)
    clique_of = np.empty((L, E), dtype=np.int64)
    for li in range(L):
        perm = rng.permutation(E)
        clique_of[li, perm] = np.minimum(np.arange(E) // m, n_cliques - 1)
    topic_pref = rng.dirichlet(np.full(n_cliques, 0.15), size=(params.n_topics, L))  # [T, L, C]
    partner = np.vstack([rng.permutation(n_cliques) for _ in range(L)])             # [L, C]

    # sessions: contiguous token ranges; each session favours a few topics and dwells on them
    bounds = np.linspace(0, tokens, sessions + 1).astype(np.int64)
    session_of = np.repeat(np.arange(sessions), np.diff(bounds))
    favour = rng.dirichlet(np.full(params.n_topics, 0.3), size=sessions)
    topic = np.empty(tokens, dtype=np.int64)
    for s in range(sessions):
        t, end = bounds[s], bounds[s + 1]
        while t < end:
            run = int(rng.geometric(1.0 / max(params.topic_dwell, 1)))
            topic[t : t + run] = rng.choice(params.n_topics, p=favour[s])
            t += run

    experts = np.empty((tokens, L, k), dtype=np.int16)
    gates = np.empty((tokens, L, k), dtype=np.float32)
    clique = None
    strength = params.clique_strength
    for li in range(L):
        pref = topic_pref[topic, li]                                   # [N, C]
        fresh = (pref.cumsum(axis=1) > rng.random((tokens, 1))).argmax(axis=1)
        if clique is not None:
            follow = rng.random(tokens) < params.coupling
            fresh = np.where(follow, partner[li - 1][clique], fresh)
        clique = fresh
        member = clique_of[li][None, :] == clique[:, None]             # [N, E]
        w = ((1.0 - strength) * heat[li]).astype(np.float32)[None, :] + np.float32(strength / m) * member
        u = rng.random((tokens, E), dtype=np.float32)
        np.clip(u, 1e-30, None, out=u)
        scores = np.log(w) - np.log(-np.log(u))                        # Gumbel top-k
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        top_scores = np.take_along_axis(scores, top, axis=1)
        order = np.argsort(-top_scores, axis=1)
        experts[:, li] = np.take_along_axis(top, order, axis=1)
        logits = np.sort(rng.normal(size=(tokens, k)), axis=1)[:, ::-1]
        g = np.exp(logits)
        gates[:, li] = g / g.sum(axis=1, keepdims=True)

    n_rows = tokens * L
    return RoutingTrace(
        layers=np.asarray(layers, dtype=np.int16),
        n_experts=E,
        top_k=k,
        geometry=geometry,
        sessions=[f"synth-{seed}-s{s:03d}" for s in range(sessions)],
        row_forward=np.repeat(np.arange(tokens, dtype=np.int32), L),
        row_layer=np.tile(np.asarray(layers, dtype=np.int16), tokens),
        row_position=np.zeros(n_rows, dtype=np.int32),
        experts=experts.reshape(n_rows, k),
        gates=gates.reshape(n_rows, k),
        fwd_session=session_of.astype(np.int32),
        fwd_kind=np.full(tokens, FORWARD_KINDS.index("decode"), dtype=np.int8),
        fwd_evaluated=np.ones(tokens, dtype=np.int32),
        fwd_committed=np.ones(tokens, dtype=np.int32),
        source=f"synth(seed={seed})",
        meta={"format": "synthetic", "params": params.__dict__, "seed": seed,
              "planted_cliques": {str(layer): [np.flatnonzero(clique_of[li] == c).tolist() for c in range(n_cliques)]
                                  for li, layer in enumerate(layers)}},
    )


@dataclass(frozen=True)
class FitReport:
    clique_size: int
    clique_strength: float
    entropy_error_bits: float        # mean |synthetic - atlas| heat entropy per layer
    lift_median: tuple[float, float]  # (synthetic, atlas), median over layers of per-layer medians
    lift_p90: tuple[float, float]

    def lines(self) -> list[str]:
        return [
            f"fit: clique size {self.clique_size}, clique strength {self.clique_strength:.3f}",
            f"fit: heat entropy error {self.entropy_error_bits:.3f} bits (mean over layers)",
            f"fit: lift median {self.lift_median[0]:.2f} vs atlas {self.lift_median[1]:.2f}; "
            f"p90 {self.lift_p90[0]:.2f} vs atlas {self.lift_p90[1]:.2f}",
        ]


def _lift_summary(per_layer: list[np.ndarray]) -> tuple[float, float]:
    med = [np.median(x) for x in per_layer if len(x)]
    p90 = [np.percentile(x, 90) for x in per_layer if len(x)]
    return (float(np.median(med)) if med else 0.0, float(np.median(p90)) if p90 else 0.0)


FIT_MAX_TOKENS = 20_000
"""Fitting simulates at most this many tokens (the Qwen atlas saw 75,773; fitting at full volume
takes minutes for little change in the lift statistics of the top pairs)."""


def fit_atlas(atlas: Atlas, seed: int = 0, params: SynthParams = SynthParams(), layer_sample: int = 8) -> tuple[SynthParams, FitReport]:
    """Tune clique size and strength so atlas-style lift statistics match ``atlas``.

    The per-layer heat is taken from the atlas directly. For each clique size in
    {k/2, k, 2k, 4k} a bisection on the clique strength matches the median lift (synthetic traces
    of ``atlas.tokens`` tokens over a sample of layers, as many as the atlas saw); the size whose
    p90 lift comes closest to the atlas's wins.
    """
    idx = np.linspace(0, len(atlas.layers) - 1, min(layer_sample, len(atlas.layers))).astype(int)
    target = _lift_summary([atlas.pairs[i][:, 3] for i in idx])
    n_tok = min(atlas.tokens, FIT_MAX_TOKENS)

    def measure(p: SynthParams):
        tr = synth_trace([atlas.layers[i] for i in idx], atlas.n_experts, atlas.k, n_tok, 10, seed, p, atlas.heat[idx])
        rows = tr.experts.reshape(n_tok, len(idx), atlas.k)
        return _lift_summary([atlas_style_lifts(rows[:, j].astype(np.int64), atlas.n_experts) for j in range(len(idx))])

    best = None
    for size in sorted({max(2, atlas.k // 2), atlas.k, 2 * atlas.k, 4 * atlas.k}):
        lo, hi = 0.0, 0.97
        for _ in range(8):
            mid = (lo + hi) / 2
            if measure(replace(params, clique_size=size, clique_strength=mid))[0] < target[0]:
                lo = mid
            else:
                hi = mid
        cand = replace(params, clique_size=size, clique_strength=(lo + hi) / 2)
        got = measure(cand)
        err = abs(np.log(max(got[0], 1e-9) / target[0])) + abs(np.log(max(got[1], 1e-9) / target[1]))
        if best is None or err < best[0]:
            best = (err, cand, got)
    _, fitted, got = best
    tr = synth_trace(atlas.layers, atlas.n_experts, atlas.k, n_tok, 10, seed, fitted, atlas.heat)
    ent_err = float(np.mean(np.abs(entropy_bits(tr.expert_heat()) - entropy_bits(atlas.heat))))
    return fitted, FitReport(fitted.clique_size, fitted.clique_strength, ent_err, (got[0], target[0]), (got[1], target[1]))
