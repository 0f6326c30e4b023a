"""Placement arms at equal RAM (experiment E3, hypothesis H3a): which whole experts to pin, the LRU holding the rest.

The runtime keeps two tiers of whole experts in RAM: a pinned store chosen before decoding and a
per-layer LRU. Every arm gets the same RAM budget ``R`` bytes; its pins take
``pin_bytes`` of it and the LRU gets exactly ``R - pin_bytes`` (so pins that are not worth their
bytes cost the LRU their room: that is the displacement). Arms:

``lru``
    no pins, the whole budget is LRU (colibrì with ``PIN`` unset and no usage history).
``frequency``
    colibrì's ``PIN`` ranking: training selection counts, highest first, across layers (ties by
    layer, then expert id, as its ``usage_rank_cmp``), until ``pin_share x R`` bytes are pinned.
``hybrid``
    recency and frequency combined as LRFU's combined recency-frequency value: each training
    selection weighs ``2 ** -((t_end - t) / half_life)`` (``t`` the step, counted in training
    steps), so recent selections weigh more; pinned best first under the same ``pin_share x R``.
    (colibrì's periodic ``REPIN`` moves pins during decoding; the replay's pin set is static, so
    this arm is its static counterpart, not a model of ``REPIN``.)
``probability-per-byte``
    the probability that the expert is in a step's batch union of its layer (training steps),
    per byte of the expert, under ``pin_share x R``.
``stall-value``
    the stall avoided per byte, measured by replay on the training sessions (the estimator below).

**The stall-value estimator.** Replay the training sessions with no pins and the LRU at ``R``;
the model reports ``expert_wait`` [L, E], the seconds the compute thread waited right before
each expert's matmul, summed over the training steps. Its value per byte, ``wait / bytes``, is
the first-order stall a pin of that expert removes (gross: it ignores that the pin shrinks the
LRU). For each pin share ``s`` of a grid (:data:`PIN_SHARES`, plus the arms' ``pin_share``) the
best experts by value per byte are pinned within ``s x R`` and the training sessions are
replayed again with the LRU at ``R`` minus the pins; the experts left unpinned get their new
wait (which now includes what the smaller LRU costs them), pinned ones keep their first-round
value, and the pins are chosen once more and replayed. One more candidate nets displacement
explicitly, as ``V(e) = (E[dW_e | resident] - E[C_displace]) / b_e``: the LRU-only
replays at ``R`` and at ``R / 2`` give the LRU's marginal stall per byte (their S difference over
``R / 2`` bytes, s per committed token per byte), and an expert's net value per byte is its wait
per committed token per byte minus that slope; experts of positive net value are pinned best
first (at most ``R``), then replayed and chosen again once, like the others. Among all these
candidates, the LRU-only replay and the frequency arm's pins, the arm keeps the pin set with the
lowest replayed S on the training sessions. So, **by construction**, the
stall-value arm's training S is never above the frequency arm's or the LRU-only arm's at the same
RAM (guaranteed by keeping the better candidate, not
discovered); on held-out sessions it can lose, and the table says so when it does.

Every arm is then replayed on the held-out sessions (by routing content, :mod:`replay.evaluation.evidence`):
S (stall per committed token) with a 95% bootstrap interval, the RAM hit rate (union lookups
served by a pin or the LRU) beside it, and the paired saving against the frequency arm.

References
----------
D. Lee, J. Choi, J.-H. Kim, S. H. Noh, S. L. Min, Y. Cho, C. S. Kim, "LRFU: A spectrum of
policies that subsumes the least recently used and least frequently used policies", IEEE Trans.
Computers 50(12), 2001.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from containers import records
from containers.errors import InputError
from containers.layout import Layout

from replay.model.config import RuntimeConfig, greedy_by_value
from replay.model.device import ArrayProfile
from replay.evaluation.evidence import MIN_SESSIONS, Evidence, split_sessions_by_content, sufficiency
from replay.evaluation.gate import (
    LayoutRun,
    check_trace_matches,
    evaluation_forwards,
    held_out_evidence,
    run_layout,
    training_coupling,
)
from replay.formats.interval import Interval
from replay.model.figures import LayoutMetrics
from replay.model.metrics import summarize
from replay.formats.pinfile import PinRecord
from replay.formats.planfile import Plan
from replay.model.streaming import replay_steps
from replay.model.routing import FORWARD_KINDS, RoutingTrace

ARMS = ("lru", "frequency", "hybrid", "probability-per-byte", "stall-value")
PIN_SHARES = (0.25, 0.5, 0.75, 1.0)
"""Pin shares of the RAM budget the stall-value search replays (besides the arms' own share)."""
DEFAULT_PIN_SHARE = 0.5
"""colibrì's default with ``PIN`` set and no ``PIN_GB``: half of the expert slots are pins."""


@dataclass(frozen=True)
class PinSet:
    """One arm's RAM split: the pinned experts [L, E], their bytes, the LRU's bytes (the rest).

    ``ranking`` lists the pinned (layout layer index, expert) pairs best first, as the arm ranks
    them; ``how`` says how they were chosen.
    """

    arm: str
    pinned: np.ndarray
    ranking: list[tuple[int, int]]
    pin_bytes: int
    lru_bytes: int
    pin_share: float
    how: str


@dataclass(frozen=True)
class ArmResult:
    """One arm: its pins, S on the training sessions, and on the held-out sessions S with its 95%
    interval (seconds per committed token), the RAM hit rate (union lookups served from RAM, pins
    and LRU) and the paired saving against the frequency arm (seconds per committed token,
    positive = this arm stalls less)."""

    pins: PinSet
    train_stall_per_token_s: float
    train_ram_hit_rate: float
    stall_per_token_s: Interval
    ram_hit_rate: float
    saving_vs_frequency_s: Interval | None


PLACEMENT_FORMAT = "relayout.placement"


@dataclass(frozen=True)
class PlacementArmRecord(PinRecord):
    """One arm as ``relayout placement --json`` writes it: its pins as plan.json records them
    (the :class:`replay.formats.pinfile.PinRecord` fields, first), then the arm's share of RAM for
    pins and its figures (as :class:`ArmResult`; an interval is None where it was not computed)."""

    pin_share: float
    train_stall_per_token_s: float
    train_ram_hit_rate: float
    stall_per_token_s: Interval | None
    ram_hit_rate: float
    saving_vs_frequency_s: Interval | None


@dataclass(frozen=True)
class PlacementTable:
    """``relayout placement --json``: the study's budget (bytes), device and evidence, and every arm."""

    format: str
    ram_bytes: int
    pin_share: float
    device: str
    training_sessions: int
    held_out_sessions: int
    method: str
    sufficient: bool
    sufficiency: str
    stall_value_replays: int
    arms: list[PlacementArmRecord]

    def to_json(self) -> dict:
        return records.to_json(self)

    @classmethod
    def from_json(cls, obj, where: str | None) -> "PlacementTable":
        return records.from_json(cls, obj, where, "placement table")


@dataclass(frozen=True)
class PlacementStudy:
    """Every arm at one RAM budget (bytes), on one device, and what the evidence allows."""

    ram_bytes: int
    pin_share: float
    device: str
    training_sessions: int
    held_out_sessions: int
    method: str                 # "session" or "moving-block": how the intervals resample
    sufficient: bool
    sufficiency: str
    stall_value_replays: int    # training replays the stall-value search ran
    arms: list[ArmResult]
    layers: list[int]           # absolute layer number of each layout layer index

    def arm(self, name: str) -> ArmResult:
        """The result of arm ``name`` (one of :data:`ARMS` that was run)."""
        for a in self.arms:
            if a.pins.arm == name:
                return a
        raise InputError(None, f"placement arm {name!r} was not run (ran {', '.join(a.pins.arm for a in self.arms)})")

    def pin_record(self, name: str) -> PinRecord:
        """Arm ``name``'s pins as plan.json records them (absolute layers, best first)."""
        p = self.arm(name).pins
        return PinRecord(p.arm, self.ram_bytes, p.pin_bytes, p.lru_bytes, self.device, p.how,
                         [(self.layers[li], e) for li, e in p.ranking])

    def record(self) -> PlacementTable:
        """The study as its typed record (what ``to_json`` writes)."""
        arms = [PlacementArmRecord(**vars(self.pin_record(a.pins.arm)), pin_share=a.pins.pin_share,
                                   train_stall_per_token_s=a.train_stall_per_token_s,
                                   train_ram_hit_rate=a.train_ram_hit_rate, stall_per_token_s=a.stall_per_token_s,
                                   ram_hit_rate=a.ram_hit_rate, saving_vs_frequency_s=a.saving_vs_frequency_s)
                for a in self.arms]
        return PlacementTable(format=PLACEMENT_FORMAT, ram_bytes=self.ram_bytes, pin_share=self.pin_share,
                              device=self.device, training_sessions=self.training_sessions,
                              held_out_sessions=self.held_out_sessions, method=self.method, sufficient=self.sufficient,
                              sufficiency=self.sufficiency, stall_value_replays=self.stall_value_replays, arms=arms)

    def to_json(self) -> dict:
        return self.record().to_json()


def training_forwards(trace: RoutingTrace, plan: Plan) -> np.ndarray:
    """Decode and verify forwards [F] of the plan's training sessions (by routing content)."""
    train = split_sessions_by_content(trace, [plan]).training
    if not train:
        raise InputError(trace.source or None, "placement needs the plan's training sessions in the trace (to learn pins from)")
    return trace.session_forward_mask(train) & (trace.fwd_kind != FORWARD_KINDS.index("prefill"))


def selection_counts(trace: RoutingTrace, forwards: np.ndarray, layout: Layout) -> np.ndarray:
    """[L, E] selections (rows that route to the expert) in the forwards of mask ``forwards``."""
    E = layout.n_experts
    out = np.zeros((len(layout.layers), E))
    for li, layer in enumerate(layout.layers):
        sel = trace.experts[trace.layer_rows(layer, forwards)]
        out[li] = np.bincount(sel[sel >= 0].astype(np.int64), minlength=E)[:E]
    return out


def union_probability(trace: RoutingTrace, forwards: np.ndarray, layout: Layout) -> np.ndarray:
    """[L, E] probability that the expert is in a step's batch union of its layer (training steps
    in which the layer is routed)."""
    E = layout.n_experts
    out = np.zeros((len(layout.layers), E))
    for li, layer in enumerate(layout.layers):
        rows = trace.layer_rows(layer, forwards)
        if not len(rows):
            continue
        sel = trace.experts[rows].astype(np.int64)
        fw = np.broadcast_to(trace.row_forward[rows].astype(np.int64)[:, None], sel.shape)
        keep = sel >= 0
        pairs = np.unique(fw[keep] * E + sel[keep])
        out[li] = np.bincount(pairs % E, minlength=E)[:E] / len(np.unique(trace.row_forward[rows]))
    return out


def lrfu_value(trace: RoutingTrace, forwards: np.ndarray, layout: Layout, half_life_steps: float) -> np.ndarray:
    """[L, E] LRFU combined recency-frequency value at the end of the training steps: each
    selection weighs ``2 ** -(steps after it / half_life_steps)``."""
    if not half_life_steps > 0:
        raise InputError(None, f"the hybrid arm's half-life must be positive (got {half_life_steps})")
    E = layout.n_experts
    fw = np.flatnonzero(forwards)
    age = np.full(trace.n_forwards, np.inf)
    age[fw] = len(fw) - 1 - np.arange(len(fw))
    out = np.zeros((len(layout.layers), E))
    for li, layer in enumerate(layout.layers):
        rows = trace.layer_rows(layer, forwards)
        sel = trace.experts[rows].astype(np.int64)
        w = np.broadcast_to(np.exp2(-age[trace.row_forward[rows]] / half_life_steps)[:, None], sel.shape)
        keep = sel >= 0
        out[li] = np.bincount(sel[keep], weights=w[keep], minlength=E)[:E]
    return out


def pins_by_value(arm: str, value: np.ndarray, expert_bytes: np.ndarray, ram_bytes: int, pin_share: float, how: str) -> PinSet:
    """Pin the best experts by ``value`` [L, E] (highest first; ties by layer, then id) within
    ``pin_share x ram_bytes``; the LRU gets the rest of ``ram_bytes``. Experts of value <= 0 are
    never pinned.

    Parameters
    ----------
    arm : the arm's name, for the record.
    value : [L, E] the ranking value (any unit; higher pins first).
    expert_bytes : [L] one expert's bytes per layer.
    ram_bytes : the RAM budget, bytes.
    pin_share : the share of ``ram_bytes`` pins may take.
    how : how the values were made, in words.

    Returns
    -------
    :class:`PinSet`.

    >>> p = pins_by_value("frequency", np.array([[5.0, 1.0], [3.0, 0.0]]), np.array([100, 100]), 400, 0.5, "counts")
    >>> p.ranking, p.pin_bytes, p.lru_bytes
    ([(0, 0), (1, 0)], 200, 200)
    """
    budget = int(pin_share * ram_bytes)
    pinned = greedy_by_value(value, expert_bytes.astype(np.float64), budget)
    L, E = value.shape
    flat = np.lexsort((np.tile(np.arange(E), L), np.repeat(np.arange(L), E), -value.ravel()))
    ranking = [divmod(int(i), E) for i in flat if pinned.ravel()[i]]
    used = int(sum(int(expert_bytes[li]) for li, _ in ranking))
    return PinSet(arm, pinned, ranking, used, ram_bytes - used, pin_share, how)


@dataclass(frozen=True)
class TrainingReplay:
    """One pin set replayed on the training sessions: its metrics and the model's per-expert wait
    [L, E] (seconds the compute thread waited right before each expert's matmul, summed)."""

    pins: PinSet
    summary: LayoutMetrics
    wait: np.ndarray


def replay_training(trace: RoutingTrace, train: np.ndarray, layout: Layout, device: ArrayProfile, config: RuntimeConfig,
                    pins: PinSet, coupling=None) -> TrainingReplay:
    """Replay the forwards of mask ``train`` with ``pins`` pinned and the LRU at ``pins.lru_bytes``."""
    cfg = replace(config, ram_bytes=pins.lru_bytes, pin_bytes=0)
    r = replay_steps(trace, train, layout, device, cfg, pins.pinned, None, coupling)
    return TrainingReplay(pins, summarize(r.steps, r.usage, cfg.other_seconds_per_token), r.expert_wait)


def stall_value_pins(trace: RoutingTrace, train: np.ndarray, layout: Layout, device: ArrayProfile, config: RuntimeConfig,
                     ram_bytes: int, pin_share: float, lru_only: TrainingReplay, *, rivals: list[TrainingReplay],
                     coupling=None) -> tuple[TrainingReplay, int]:
    """The stall-value arm (module doc: the estimator) and the number of training replays its
    search ran. ``lru_only`` is the training replay without pins at ``ram_bytes``; ``rivals`` are
    other arms' training replays at the same RAM (the frequency arm's): the result is never worse
    on the training sessions than ``lru_only`` or any rival, because it is the best of all
    candidates, them included."""
    ebytes = layout.expert_bytes()[:, 0]
    per_byte = np.maximum(ebytes, 1)[:, None].astype(np.float64)
    v0 = lru_only.wait / per_byte
    candidates: list[TrainingReplay] = []
    for share in sorted(set(PIN_SHARES) | {pin_share}):
        first = pins_by_value("stall-value", v0, ebytes, ram_bytes, share,
                              f"replayed wait per byte without pins, pin share {share:g}")
        if not first.ranking:
            continue
        run1 = replay_training(trace, train, layout, device, config, first, coupling)
        candidates.append(run1)
        v1 = np.where(first.pinned, v0, run1.wait / per_byte)
        second = pins_by_value("stall-value", v1, ebytes, ram_bytes, share,
                               f"replayed wait per byte, chosen again after replaying the first pins, pin share {share:g}")
        if second.ranking and not np.array_equal(second.pinned, first.pinned):
            candidates.append(replay_training(trace, train, layout, device, config, second, coupling))
    # net of displacement: the LRU's marginal stall per byte, from LRU-only replays at R and R/2
    half = replay_training(trace, train, layout, device, config,
                           PinSet("lru", np.zeros_like(lru_only.pins.pinned), [], 0, ram_bytes // 2, 0.0, ""), coupling)
    tokens = max(lru_only.summary.committed_tokens, 1)
    slope = max(0.0, (half.summary.stall_per_token_s - lru_only.summary.stall_per_token_s) / max(ram_bytes - ram_bytes // 2, 1))
    net = lru_only.wait / tokens / per_byte - slope
    how = (f"replayed wait per byte net of the LRU's marginal stall per byte ({slope * 1e9:.3g} s/token per GB, "
           "from LRU-only replays at the budget and half of it)")
    netted = pins_by_value("stall-value", net, ebytes, ram_bytes, 1.0, how)
    if netted.ranking:
        run1 = replay_training(trace, train, layout, device, config, netted, coupling)
        candidates.append(run1)
        again = np.where(netted.pinned, net, run1.wait / tokens / per_byte - slope)
        second = pins_by_value("stall-value", again, ebytes, ram_bytes, 1.0, how + ", chosen again after replaying them")
        if second.ranking and not np.array_equal(second.pinned, netted.pinned):
            candidates.append(replay_training(trace, train, layout, device, config, second, coupling))
    replays = len(candidates) + 1
    for r in [lru_only, *rivals]:
        how = f"the {r.pins.arm} arm's choice: no replayed candidate stalled less on the training sessions"
        candidates.append(TrainingReplay(replace(r.pins, arm="stall-value", how=how), r.summary, r.wait))
    best = min(range(len(candidates)), key=lambda i: (candidates[i].summary.stall_per_token_s, i))
    return candidates[best], replays


def placement_arms(plan: Plan, trace: RoutingTrace, device: ArrayProfile, config: RuntimeConfig, ram_bytes: int,
                   arms: tuple[str, ...] = ARMS, pin_share: float = DEFAULT_PIN_SHARE, half_life_steps: float | None = None,
                   *, seed: int = 0, min_sessions: int = MIN_SESSIONS) -> PlacementStudy:
    """Every arm in ``arms`` at ``ram_bytes`` of RAM through the plan's layout (module doc).

    Parameters
    ----------
    plan : a plan without a split; its training sessions choose the pins.
    trace : routing trace with the plan's training sessions and held-out ones.
    device : the device profile replayed.
    config : every other runtime knob (its ``ram_bytes`` and ``pin_bytes`` are replaced by each
        arm's split of ``ram_bytes``).
    ram_bytes : the RAM budget every arm gets, bytes.
    arms : names of :data:`ARMS` to run.
    pin_share : the share of RAM the frequency, hybrid and probability-per-byte arms pin (the
        stall-value arm searches it).
    half_life_steps : the hybrid arm's half-life in training steps (default: a quarter of them).
    seed : the bootstrap's seed.
    min_sessions : held-out sessions a comparison needs.

    Returns
    -------
    :class:`PlacementStudy`: each arm's pins, training S, held-out S with its 95% interval, RAM
    hit rate and saving against the frequency arm.
    """
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise InputError(None, f"unknown placement arm {unknown[0]!r} (choose {', '.join(ARMS)})")
    if not 0 < pin_share <= 1:
        raise InputError(None, f"the pin share must be in (0, 1] (got {pin_share})")
    if ram_bytes <= 0:
        raise InputError(None, "placement arms need a RAM budget above 0 (--ram-gb)")
    if plan.split:
        raise InputError(plan.path, "placement arms compare whole-expert residency; this plan splits experts "
                                    "(use relayout split-curve for splits)")
    check_trace_matches(trace, plan)
    layout = plan.layout
    train = training_forwards(trace, plan)
    held_mask, held = evaluation_forwards(trace, [plan])
    coupling = training_coupling(trace, plan) if config.prefetch == "coupled" else None
    ebytes = layout.expert_bytes()[:, 0]
    per_byte = np.maximum(ebytes, 1)[:, None].astype(np.float64)
    L, E = len(layout.layers), layout.n_experts
    n_train = int(train.sum())
    half_life = float(half_life_steps) if half_life_steps is not None else max(n_train / 4, 1.0)

    def arm_pins(name: str) -> PinSet:
        if name == "lru":
            return PinSet("lru", np.zeros((L, E), dtype=bool), [], 0, ram_bytes, 0.0, "no pins; the whole budget is LRU")
        if name == "frequency":
            return pins_by_value(name, selection_counts(trace, train, layout), ebytes, ram_bytes, pin_share,
                                 "training selection counts, highest first (colibrì's PIN ranking)")
        if name == "hybrid":
            return pins_by_value(name, lrfu_value(trace, train, layout, half_life), ebytes, ram_bytes, pin_share,
                                 f"LRFU recency-frequency value, half-life {half_life:g} training steps")
        return pins_by_value(name, union_probability(trace, train, layout) / per_byte, ebytes, ram_bytes, pin_share,
                             "probability in a step's batch union per byte")

    chosen: dict[str, TrainingReplay] = {}
    for name in dict.fromkeys([a for a in arms if a != "stall-value"] + (["lru", "frequency"] if "stall-value" in arms else [])):
        chosen[name] = replay_training(trace, train, layout, device, config, arm_pins(name), coupling)
    replays = 0
    if "stall-value" in arms:
        chosen["stall-value"], replays = stall_value_pins(trace, train, layout, device, config, ram_bytes, pin_share,
                                                          chosen["lru"], rivals=[chosen["frequency"]], coupling=coupling)

    held_runs = {name: run_layout(name, trace, held_mask, layout, device,
                                  replace(config, ram_bytes=chosen[name].pins.lru_bytes, pin_bytes=0), chosen[name].pins.pinned,
                                  coupling=coupling)
                 for name in arms}
    units = np.array(held.evaluated)

    def evidence(base: LayoutRun, new: LayoutRun | None) -> Evidence:
        return held_out_evidence(base, new, units, seed)

    freq = held_runs.get("frequency")
    results = []
    for name in arms:
        t = chosen[name]
        run = held_runs[name]
        saving = None if freq is None or name == "frequency" else Interval(*evidence(freq, run).interval())
        results.append(ArmResult(t.pins, t.summary.stall_per_token_s, t.summary.ram_hit_rate,
                                 Interval(*evidence(run, None).interval()), run.summary.ram_hit_rate, saving))
    probe = evidence(held_runs[arms[0]], None)
    sufficient, why = sufficiency(probe, min_sessions, verdict=False)
    return PlacementStudy(ram_bytes, pin_share, device.name, len(split_sessions_by_content(trace, [plan]).training),
                          len(units), probe.method, sufficient, why, replays, results, list(layout.layers))


__all__ = ["ARMS", "ArmResult", "DEFAULT_PIN_SHARE", "PIN_SHARES", "PLACEMENT_FORMAT", "PinSet", "PlacementArmRecord",
           "PlacementStudy", "PlacementTable", "lrfu_value", "pins_by_value",
           "placement_arms", "selection_counts", "stall_value_pins", "training_forwards", "union_probability"]
