"""The experiments E2, E3 and E5 replayed: each hypothesis's arms on the plan's held-out steps.

One function per experiment returns the arms as :class:`replay.evaluation.hypotheses.ArmSteps` (all on the
same held-out steps of the plan's layout), and :func:`hypothesis_tables` turns them into the
tables of :mod:`replay.evaluation.hypotheses`, one per hypothesis and regime (RAM budget x speculative-byte
budget). Every knob not named here comes from the caller's :class:`~replay.model.config.RuntimeConfig`.

* **E2 / H2** (:func:`admission_arms`): no prefetch (``none``, S_0 of eta_stall) and each admission
  policy over one prediction source learned on the training sessions, all with the same
  speculative-byte budget ``prefetch_bytes`` (B) and queue-slot budget ``prefetch_experts`` (Q).
* **E3 / H3a** (:func:`placement_arm_steps`): the placement arms of :mod:`replay.control.placement` at
  one RAM budget, each replayed with its own pins and LRU.
* **E3 / H3b** (:func:`split_arm_steps`): the whole-expert and split-expert points of
  :mod:`replay.control.splitcurve` at each RAM budget, each replayed.
* **E5 / H5** (:func:`tail_arms`): the runtime's admission (``default``: its top-K rule, no byte
  budget), a fixed byte budget, stale cancellation, the queue-aware adaptive budget, and all of
  them with backoff (``tail-control``, the arm H5 judges). Over several sources (``"a+b"``: their
  fused probability, :mod:`replay.model.predictors`) the arms rank on the fused probability and one
  more arm, ``source-caps``, is ``tail-control`` with per-source caps (:mod:`replay.model.admission`;
  each source an equal share of B and Q unless the configuration gives ``source_caps``); H5 is
  then judged twice, once with each (:func:`regime_tables`).

Regimes are independent: :func:`hypothesis_tables` runs one task per regime on an executor
(:mod:`replay.execution`), so a sweep runs the same on the serial path and on a Dask cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from containers.errors import InputError

from replay.model.config import ADMISSION_POLICIES, RuntimeConfig, prefetch_sources
from replay.model.device import ArrayProfile
from replay.model.engine import SplitState
from replay.evaluation.evidence import MIN_SESSIONS
from replay.evaluation.gate import (
    check_trace_matches,
    evaluation_forwards,
    run_layout,
    training_coupling,
)
from replay.evaluation.hypotheses import (
    ArmSteps,
    HypothesisTable,
    admission_table,
    arm_from_run,
    placement_table,
    split_table,
    tail_table,
)
from replay.formats.planfile import Plan
from replay.model.routing import RoutingTrace

ADMISSION_ARMS = ("probability", "per-byte", "deadline", "stall-value", "oracle")
"""The admission policies E2 compares (besides ``none``)."""
HYPOTHESIS_KEYS = ("H2", "H3a", "H3b", "H5")


def _held_out(trace: RoutingTrace, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    from replay.control.placement import training_forwards

    check_trace_matches(trace, plan)
    mask, _ = evaluation_forwards(trace, [plan])
    return mask, training_forwards(trace, plan)


def _no_pins(plan: Plan) -> np.ndarray:
    return np.zeros((len(plan.layout.layers), plan.layout.n_experts), dtype=bool)


def learned_source(trace: RoutingTrace, plan: Plan, source: str, train: np.ndarray):
    """The prediction source ``source`` learned on the plan's training forwards ``train`` (several
    sources, ``"a+b"``: their :class:`replay.model.predictors.FusedModel`)."""
    from replay.control.sources import learn_fused, learn_source

    if source in ("none", "oracle"):
        return None
    names = prefetch_sources(source)
    if len(names) > 1:
        return learn_fused(names, trace, train, plan.layout)
    return learn_source(source, trace, train, plan.layout)


def predictor_scores(plan: Plan, trace: RoutingTrace, source: str) -> list:
    """Each source of ``source`` and (several sources) their fusion, learned on the plan's
    training sessions and scored on its held-out ones (:class:`replay.control.sources.Reliability`):
    the reader sees whether fusing helps."""
    from replay.control.sources import score_source

    mask, train = _held_out(trace, plan)
    learned = learned_source(trace, plan, source, train)
    if learned is None:
        return []
    models = list(getattr(learned, "sources", [])) + [learned]
    return [score_source(m, trace, mask, plan.layout) for m in models]


def admission_arms(plan: Plan, trace: RoutingTrace, device: ArrayProfile, config: RuntimeConfig,
                   policies: tuple[str, ...] = ADMISSION_ARMS, source: str = "coupled") -> dict[str, ArmSteps]:
    """E2: ``none`` and each policy of ``policies`` over ``source``, equal budgets (module doc).

    Parameters
    ----------
    plan, trace : the plan (its layout, training and held-out sessions) and the routing trace.
    device, config : the device profile and the runtime knobs not named here.
    policies : the admission policies compared (of :data:`ADMISSION_ARMS`).
    source : the prediction source, learned on the training sessions.

    Returns
    -------
    Arm name -> :class:`~replay.evaluation.hypotheses.ArmSteps` on the same held-out steps.
    """
    bad = [p for p in policies if p not in ADMISSION_POLICIES or p in ("top-k", "observe")]
    if bad:
        raise InputError(None, f"{bad[0]!r} is not an admission policy E2 compares "
                               f"(choose from {', '.join(ADMISSION_ARMS)})")
    if source == "none":
        raise InputError(None, "admission policies need a prediction source (--prefetch)")
    mask, train = _held_out(trace, plan)
    learned = learned_source(trace, plan, source, train)
    pins = _no_pins(plan)
    off = replace(config, prefetch="none", source_caps=[])
    arms = {"none": arm_from_run(run_layout("none", trace, mask, plan.layout, device, off, pins))}
    for p in policies:
        cfg = replace(config, prefetch=source, admission=p)
        arms[p] = arm_from_run(run_layout(p, trace, mask, plan.layout, device, cfg, pins, coupling=learned))
    return arms


TAIL_ARMS = ("default", "fixed-budget", "cancel", "adaptive", "tail-control")
"""E5's arms (module doc); ``tail-control`` is the one H5 judges."""
CAPS_ARM = "source-caps"
"""E5's arm over several sources: ``tail-control`` with per-source caps."""


def tail_configs(config: RuntimeConfig, source: str = "coupled") -> dict[str, RuntimeConfig]:
    """E5's arms as configurations: the runtime's top-K rule over ``source`` with no byte budget,
    then the byte budget ``config.prefetch_bytes`` (default: the K largest experts' worth is the
    caller's to set), stale cancellation, the adaptive budget, and all three with backoff; over
    several sources, also :data:`CAPS_ARM` (caps ``config.source_caps``, else equal shares)."""
    names = prefetch_sources(source)
    default = replace(config, prefetch=source, admission="top-k", prefetch_bytes=0, cancel_stale=False,
                      adaptive_budget=False, backoff=False, source_caps=[])
    budget = replace(default, prefetch_bytes=config.prefetch_bytes)
    arms = {"default": default, "fixed-budget": budget, "cancel": replace(budget, cancel_stale=True),
            "adaptive": replace(budget, adaptive_budget=True),
            "tail-control": replace(budget, cancel_stale=True, adaptive_budget=True, backoff=True)}
    if len(names) > 1:
        caps = config.source_caps if config.prefetch == source and config.source_caps else [1.0 / len(names)] * len(names)
        arms[CAPS_ARM] = replace(arms["tail-control"], source_caps=caps)
    return arms


def tail_arms(plan: Plan, trace: RoutingTrace, device: ArrayProfile, config: RuntimeConfig,
              source: str = "coupled") -> dict[str, ArmSteps]:
    """E5: the arms of :func:`tail_configs` on the held-out steps.

    Parameters
    ----------
    plan, trace : the plan (its layout, training and held-out sessions) and the routing trace.
    device, config : the device profile and the runtime knobs not named here.
    source : the prediction source; ``config.prefetch_bytes`` must be above 0.

    Returns
    -------
    Arm name -> :class:`~replay.evaluation.hypotheses.ArmSteps` on the same held-out steps.
    """
    if config.prefetch_bytes <= 0:
        raise InputError(None, "E5 compares byte budgets: give a speculative-byte budget (--prefetch-budget-mb)")
    mask, train = _held_out(trace, plan)
    pins = _no_pins(plan)
    table = training_coupling(trace, plan) if source == "coupled" else None
    learned = learned_source(trace, plan, source, train)
    arms = {}
    for name, cfg in tail_configs(config, source).items():
        # the runtime's top-K rule takes the coupled pair table as it is; the other rules its probabilities
        coupling = table if (cfg.admission == "top-k" and source == "coupled") else learned
        arms[name] = arm_from_run(run_layout(name, trace, mask, plan.layout, device, cfg, pins, coupling=coupling))
    return arms


def placement_arm_steps(plan: Plan, trace: RoutingTrace, device: ArrayProfile, config: RuntimeConfig,
                        ram_bytes: int) -> dict[str, ArmSteps]:
    """E3 placement: each arm's pins and LRU (chosen on training sessions by
    :func:`replay.control.placement.placement_arms`) replayed on the held-out steps.

    Parameters
    ----------
    plan, trace : the plan (its layout, training and held-out sessions) and the routing trace.
    device, config : the device profile and the runtime knobs not named here.
    ram_bytes : the RAM budget every arm gets, bytes.

    Returns
    -------
    Arm name -> :class:`~replay.evaluation.hypotheses.ArmSteps` on the same held-out steps.
    """
    from replay.control.placement import placement_arms

    study = placement_arms(plan, trace, device, config, ram_bytes)
    mask, _ = _held_out(trace, plan)
    coupling = training_coupling(trace, plan) if config.prefetch == "coupled" else None
    arms = {}
    for a in study.arms:
        cfg = replace(config, ram_bytes=a.pins.lru_bytes, pin_bytes=0)
        arms[a.pins.arm] = arm_from_run(run_layout(a.pins.arm, trace, mask, plan.layout, device, cfg, a.pins.pinned,
                                                   coupling=coupling))
    return arms


def split_arm_steps(plan: Plan, trace: RoutingTrace, device: ArrayProfile, config: RuntimeConfig,
                    ram_bytes: list[int]) -> dict[int, tuple[ArmSteps, ArmSteps]]:
    """E3 splits: at each RAM budget, the whole-expert point and the split point the search of
    :func:`replay.control.splitcurve.split_curve` chose on training sessions, replayed on the held-out steps.

    Parameters
    ----------
    plan, trace : the plan (its layout, training and held-out sessions) and the routing trace.
    device, config : the device profile and the runtime knobs not named here.
    ram_bytes : RAM budgets, bytes.

    Returns
    -------
    RAM budget -> (whole-expert arm, split arm), each :class:`~replay.evaluation.hypotheses.ArmSteps`.
    """
    from replay.control.splitcurve import split_curve

    curve = split_curve(plan, trace, device, config, ram_bytes)
    mask, _ = _held_out(trace, plan)
    pins = _no_pins(plan)
    ffn = plan.geometry.moe_intermediate_size
    L = len(plan.layout.layers)
    out = {}
    for whole, split in zip(curve.whole, curve.split):
        w = run_layout("whole", trace, mask, plan.layout, device, replace(config, ram_bytes=whole.lru_bytes, pin_bytes=0), pins)
        state = None
        if split.ratio > 0 and split.resident is not None:
            state = SplitState(np.asarray(split.resident, dtype=bool), np.asarray(split.top_rows, dtype=np.float64)[:L] / ffn)
        s = run_layout("split", trace, mask, plan.layout, device, replace(config, ram_bytes=split.lru_bytes, pin_bytes=0),
                       pins, state)
        out[whole.ram_bytes] = (arm_from_run(w), arm_from_run(s))
    return out


@dataclass(frozen=True)
class Regime:
    """One cell of a sweep: the RAM budget (bytes) and the speculative-byte budget per layer (bytes)."""

    ram_bytes: int
    prefetch_bytes: int

    def words(self) -> str:
        """The regime in words.

        >>> Regime(2_000_000_000, 0).words(), Regime(10**9, 4_000_000).words()
        ('RAM 2 GB, no byte budget', 'RAM 1 GB, B = 4 MB per layer')
        """
        b = "no byte budget" if self.prefetch_bytes <= 0 else f"B = {self.prefetch_bytes / 1e6:g} MB per layer"
        return f"RAM {self.ram_bytes / 1e9:.3g} GB, {b}"


def regime_tables(plan: Plan, trace: RoutingTrace, device: ArrayProfile, config: RuntimeConfig, regime: Regime,
                  keys: tuple[str, ...], policies: tuple[str, ...], source: str, *, min_sessions: int) -> list[HypothesisTable]:
    """Every hypothesis of ``keys`` at one regime (one task of :func:`hypothesis_tables`).

    Parameters
    ----------
    plan, trace, device, config : the plan, routing trace, device profile and runtime knobs.
    regime : the RAM and speculative-byte budgets.
    keys : hypotheses to judge (of :data:`HYPOTHESIS_KEYS`).
    policies : the admission policies H2 compares.
    source : the prediction source (``"a+b"`` fuses several).
    min_sessions : held-out sessions a verdict needs.

    Returns
    -------
    The regime's :class:`~replay.evaluation.hypotheses.HypothesisTable` list, in hypothesis order.
    """
    cfg = replace(config, ram_bytes=regime.ram_bytes, prefetch_bytes=regime.prefetch_bytes)
    off = replace(cfg, prefetch="none", source_caps=[])
    words = regime.words()
    out = []
    if "H2" in keys:
        out.append(admission_table(admission_arms(plan, trace, device, cfg, policies, source), words, min_sessions))
    if "H3a" in keys and regime.ram_bytes > 0:
        out.append(placement_table(placement_arm_steps(plan, trace, device, off, regime.ram_bytes),
                                   words, min_sessions))
    if "H3b" in keys and regime.ram_bytes > 0:
        curve = split_arm_steps(plan, trace, device, off, [regime.ram_bytes])
        out.append(split_table(curve, words, min_sessions))
    if "H5" in keys and regime.prefetch_bytes > 0:
        arms = tail_arms(plan, trace, device, cfg, source)
        out.append(tail_table(arms, words, min_sessions))
        if CAPS_ARM in arms:
            out.append(tail_table(arms, words, min_sessions, test_arm=CAPS_ARM))
    return out


def hypothesis_tables(plan: Plan, trace: RoutingTrace, device: ArrayProfile, config: RuntimeConfig,
                      ram_bytes: list[int], prefetch_bytes: list[int], keys: tuple[str, ...] = HYPOTHESIS_KEYS,
                      policies: tuple[str, ...] = ADMISSION_ARMS, *, source: str = "coupled",
                      min_sessions: int = MIN_SESSIONS, executor=None) -> list[HypothesisTable]:
    """The tables of ``keys`` over every regime RAM x byte budget, one executor task per regime.

    H3a and H3b need RAM (regimes with ``ram_bytes`` 0 skip them), H5 a byte budget (regimes
    with ``prefetch_bytes`` 0 skip it).

    Parameters
    ----------
    plan, trace, device, config, keys, policies, source, min_sessions : as for :func:`regime_tables`.
    ram_bytes : RAM budgets, bytes.
    prefetch_bytes : speculative-byte budgets per layer, bytes.
    executor : where the regimes run (default: serially, in this process).

    Returns
    -------
    The tables, in regime order, then hypothesis order.
    """
    from replay.execution import SerialExecutor

    unknown = [k for k in keys if k not in HYPOTHESIS_KEYS]
    if unknown:
        raise InputError(None, f"unknown hypothesis {unknown[0]!r} (choose {', '.join(HYPOTHESIS_KEYS)})")
    executor = executor or SerialExecutor()
    regimes = [Regime(int(r), int(b)) for r in ram_bytes for b in prefetch_bytes]
    shared = [executor.share(x) for x in (plan, trace, device)]
    per = executor.map(partial(regime_tables, min_sessions=min_sessions),
                       [(*shared, config, g, tuple(keys), tuple(policies), source) for g in regimes], desc="hypothesis regimes")
    return [t for tables in per for t in tables]


__all__ = ["ADMISSION_ARMS", "CAPS_ARM", "HYPOTHESIS_KEYS", "Regime", "TAIL_ARMS", "admission_arms", "hypothesis_tables",
           "learned_source", "placement_arm_steps", "predictor_scores", "regime_tables", "split_arm_steps", "tail_arms",
           "tail_configs"]
