"""What a replay asks of the model: the runtime configuration its options describe, the RAM budgets
a sweep covers, the hypothesis tables and regimes a policy study runs, the pins a runtime PIN file
can carry and the split state a measured container needs. Sizes arrive as the command line gives
them (GB, MB, ms, GB/s) and leave as the model takes them (bytes, seconds, bytes/s); every
function is pure but for reading a colibrì run's output when a request names one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from containers.errors import InputError

SWEEP_RAM_SHARES = (0.0, 0.125, 0.25, 0.5)
"""A sweep's RAM budgets when none are given: these shares of the plan's routed expert bytes."""


@dataclass(frozen=True, kw_only=True)
class RuntimeRequest:
    """The runtime knobs a command was given, in the command line's units.

    ``colibri_run`` says whether the command describes a colibrì run (``runtime_env``,
    ``runtime_env_from`` and ``page_cache_gb`` then apply); without it the request is relayout's
    own read path only (the emulating harness).
    """

    coalesce_max_mb: float             # largest coalesced read, MB
    dense_ms: float                    # per-layer compute before routing, ms
    ram_gb: float = 0.0                # the expert LRU, GB
    workers: int | None = None         # relayout's read path: reader workers (None: not chosen)
    batched: bool = False
    coalesce: bool = False
    buffered: bool = False
    pin_gb: float = 0.0
    compute_gbps: float | None = None  # expert matmul rate, GB/s (None: the run's own, else the model's)
    other_ms: float = 0.0              # other overhead per token, ms
    prefetch: str = "none"
    prefetch_experts: int = 6
    prefetch_budget_mb: float = 0.0    # speculative bytes admitted per layer, MB
    source_caps: tuple[float, ...] = ()
    colibri_run: bool = False
    runtime_env: str | None = None     # colibrì's variables, 'VAR=VALUE ...'
    runtime_env_from: str | None = None  # a colibrì run's saved output
    page_cache_gb: float | None = None
    pilot_precision: float | None = None  # PILOT_REAL: the router pilot's share of right predictions (None: a run's LOOKA line)


def base_config(request: RuntimeRequest):
    """The model's configuration for relayout's own read path under ``request``.

    Parameters
    ----------
    request : RuntimeRequest
        The knobs as given.

    Returns
    -------
    replay.model.config.RuntimeConfig
        Bytes, seconds and bytes/s; 8 workers when none are chosen, 50 GB/s of expert matmul when
        no rate is given.

    Examples
    --------
    >>> c = base_config(RuntimeRequest(coalesce_max_mb=268.435456, dense_ms=1.0, ram_gb=2.5, buffered=True))
    >>> c.ram_bytes, c.workers, c.direct, c.coalesce_max_bytes, c.compute_bytes_per_second
    (2500000000, 8, False, 268435456, 50000000000.0)
    """
    from replay.model.config import RuntimeConfig

    r = request
    return RuntimeConfig(
        ram_bytes=int(r.ram_gb * 1e9), workers=r.workers or 8, batched=r.batched,
        coalesce=r.coalesce, coalesce_max_bytes=int(r.coalesce_max_mb * 1e6), direct=not r.buffered,
        pin_bytes=int(r.pin_gb * 1e9), dense_seconds=r.dense_ms / 1e3,
        compute_bytes_per_second=(r.compute_gbps or 50.0) * 1e9, other_seconds_per_token=r.other_ms / 1e3,
        prefetch=r.prefetch, prefetch_experts=r.prefetch_experts,
        prefetch_bytes=int(r.prefetch_budget_mb * 1e6),
        source_caps=list(r.source_caps or ()),
        page_cache_bytes=int((r.page_cache_gb or 0.0) * 1e9),
    )


def runtime_config(request: RuntimeRequest, layout=None):
    """The model's configuration a request describes.

    relayout's own read path when the request chooses it (workers, batched or buffered) or describes
    no colibrì run; else the colibrì run ``runtime_env`` and ``runtime_env_from`` describe (the
    engine's defaults when neither is given), its LRU sized from CAP and RAM_GB on ``layout``.

    Parameters
    ----------
    request : RuntimeRequest
        The knobs as given.
    layout : containers.layout.Layout, optional
        The layout a colibrì run's LRU and page cache are sized on (None: no sizing, the LRU as
        the model's default and no page cache unless ``page_cache_gb`` gives one).

    Returns
    -------
    replay.model.config.RuntimeConfig
        Bytes, seconds and bytes/s.

    Raises
    ------
    containers.errors.InputError
        When relayout's own read path and a colibrì run are both asked for, a run's output
        cannot be read, COLI_MMAP=1 is asked for without a run of it that timed its loads, or
        PILOT_REAL=1 without the router pilot's precision.

    Under colibrì's prefetchers (PILOT, PILOT_REAL, COUPLE) a run's decode time outside expert
    waits, matmuls and the LM head, per forward and MoE layer
    (:attr:`replay.colibri.engine_config.RunFacts.between_layers_seconds`), is the time between
    two layers' expert work (``dense_seconds``): the prefetch thread loads through it.
    """
    base = base_config(request)
    if not request.colibri_run:
        return base
    own = request.workers is not None or request.batched or request.buffered
    env, env_from = request.runtime_env, request.runtime_env_from
    if own and (env is not None or env_from):
        raise InputError(None, "--workers/--batched/--buffered choose relayout's own read path; with --runtime-env "
                               "give colibrì's PIPE, PIPE_WORKERS, URING, DIRECT instead")
    if own:
        return base
    from replay.colibri.engine_config import config_from_run, memory_terms, model_config, parse_runtime_env

    cfg, facts = None, None
    if env_from:
        cfg, facts = config_from_run(env_from)
    run_mapped = cfg is not None and cfg.COLI_MMAP
    cfg = parse_runtime_env(env or "", base=cfg)
    if cfg.COLI_MMAP and not (run_mapped and facts.decode_load_seconds):
        raise InputError("--runtime-env", "COLI_MMAP=1 is modelled from a PROF=1 run of it: give --runtime-env-from RUN "
                                          "(a page-cache hit then re-touches mapped pages, at the rate the run's decode "
                                          "loads took; no calibration measures that)")
    if request.compute_gbps is None and facts and facts.matmul_bytes_per_second:
        base = replace(base, compute_bytes_per_second=facts.matmul_bytes_per_second)
    lru, page = memory_terms(cfg, facts, layout, base.pin_bytes) if layout is not None else (-1, 0)
    if request.page_cache_gb is None:
        base = replace(base, page_cache_bytes=page)
    if (cfg.PILOT or cfg.PILOT_REAL or cfg.COUPLE) and facts and facts.between_layers_seconds and layout is not None:
        base = replace(base, dense_seconds=facts.between_layers_seconds / len(layout.layers))
    precision = request.pilot_precision or (facts.pilot_precision if facts else None)
    return model_config(cfg, base, lru, facts.omp_threads if facts else None, base.pin_bytes,
                        facts.cores if facts else None, precision)


def routed_bytes(plan) -> int:
    """Bytes of every routed expert of ``plan``'s layout (a :class:`replay.formats.planfile.Plan`)."""
    return int(plan.layout.expert_bytes().sum())


def check_ram(ram_bytes: int, routed: int) -> None:
    """Refuse a RAM budget beyond every routed expert's bytes (a mistake of units or of model).

    Parameters
    ----------
    ram_bytes : int
        The budget asked for, bytes.
    routed : int
        The model's routed expert bytes (:func:`routed_bytes`).

    Raises
    ------
    containers.errors.InputError
        When ``ram_bytes`` exceeds ``routed``.

    Examples
    --------
    >>> check_ram(4_000_000_000, 8_000_000_000)
    >>> check_ram(9_000_000_000, 8_000_000_000)
    Traceback (most recent call last):
    ...
    containers.errors.InputError: --ram-gb 9 is more than all 8 GB of this model's routed experts (every expert would stay in RAM); give the RAM the runtime has for experts
    """
    if ram_bytes > routed:
        raise InputError(None, f"--ram-gb {ram_bytes / 1e9:g} is more than all {routed / 1e9:.3g} GB of this model's routed "
                               "experts (every expert would stay in RAM); give the RAM the runtime has for experts")


def sweep_ram_gb(routed: int, given: tuple[float, ...] | None, ram_gb: float) -> list[float]:
    """The RAM budgets a sweep covers, GB.

    Parameters
    ----------
    routed : int
        The model's routed expert bytes (:func:`routed_bytes`).
    given : tuple of float or None
        Budgets asked for, GB: each is checked against ``routed`` and they are the answer as given.
    ram_gb : float
        The one budget of the run, GB; among the default budgets when it is not 0.

    Returns
    -------
    list of float
        ``given``, or :data:`SWEEP_RAM_SHARES` of ``routed`` (three significant digits) with
        ``ram_gb``, sorted.

    Examples
    --------
    >>> sweep_ram_gb(8_000_000_000, None, 3.0)
    [0.0, 1.0, 2.0, 3.0, 4.0]
    >>> sweep_ram_gb(8_000_000_000, (0.0, 6.0), 3.0)
    [0.0, 6.0]
    """
    if given:
        budgets = list(given)
        for gb in budgets:
            check_ram(int(gb * 1e9), routed)
        return budgets
    budgets = {float(f"{share * routed / 1e9:.3g}") for share in SWEEP_RAM_SHARES}
    if ram_gb:
        budgets.add(ram_gb)
    return sorted(budgets)


def hypothesis_selection(policy: str | None, hypotheses: str | None, sweep: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The admission arms and the hypothesis tables a policy study runs.

    Parameters
    ----------
    policy : str or None
        Comma-separated admission policies, ``"all"`` or None (every arm).
    hypotheses : str or None
        Comma-separated hypothesis keys; None: H2 alone, or all four with ``sweep``.
    sweep : bool
        Whether the study sweeps RAM and speculative-byte budgets.

    Returns
    -------
    tuple of (tuple of str, tuple of str)
        The policies (stall-value, the arm the claim is about, always among them) and the keys.

    Raises
    ------
    containers.errors.InputError
        For a hypothesis key that does not exist.

    Examples
    --------
    >>> hypothesis_selection("probability", None, False)
    (('probability', 'stall-value'), ('H2',))
    >>> hypothesis_selection("stall-value,oracle", None, True)[1]
    ('H2', 'H3a', 'H3b', 'H5')
    """
    from replay.control.experiments import ADMISSION_ARMS, HYPOTHESIS_KEYS

    names = ADMISSION_ARMS if policy in (None, "all") else tuple(p for p in policy.split(",") if p)
    policies = tuple(dict.fromkeys([*names, "stall-value"]))
    keys = tuple(k for k in (hypotheses or ("H2,H3a,H3b,H5" if sweep else "H2")).split(",") if k)
    unknown = [k for k in keys if k not in HYPOTHESIS_KEYS]
    if unknown:
        raise InputError(None, f"unknown hypothesis {unknown[0]!r} (choose {', '.join(HYPOTHESIS_KEYS)})")
    return policies, keys


def hypothesis_source(prefetch: str) -> str:
    """The prediction source a policy study admits from: the configured one, coupled when none.

    >>> hypothesis_source("none"), hypothesis_source("heat+session")
    ('coupled', 'heat+session')
    """
    return prefetch if prefetch != "none" else "coupled"


def hypothesis_regimes(plan, config, sweep_ram: list[float] | None,
                       sweep_budgets_mb: tuple[float, ...] | None) -> tuple[list[int], list[int]]:
    """The RAM budgets and speculative-byte budgets a policy study runs, bytes.

    Parameters
    ----------
    plan : replay.formats.planfile.Plan
        The plan replayed (its largest expert sizes the default byte budgets).
    config : replay.model.config.RuntimeConfig
        The run's configuration: its one regime when ``sweep_ram`` is None.
    sweep_ram : list of float or None
        The sweep's RAM budgets, GB (:func:`sweep_ram_gb`); None: no sweep.
    sweep_budgets_mb : tuple of float or None
        The sweep's byte budgets per layer, MB; None: half and all of ``config.prefetch_experts``
        experts' worth.

    Returns
    -------
    tuple of (list of int, list of int)
        RAM budgets and speculative-byte budgets per layer, bytes.
    """
    if sweep_ram is None:
        return [config.ram_bytes], [config.prefetch_bytes]
    expert = int(plan.layout.expert_bytes().max())
    ram = [int(x * 1e9) for x in sweep_ram]
    budgets = ([int(x * 1e6) for x in sweep_budgets_mb] if sweep_budgets_mb else
               sorted({max(1, config.prefetch_experts // 2) * expert, config.prefetch_experts * expert}))
    return ram, budgets


def runtime_pins(plan, experts) -> tuple[list[tuple[int, int]], int]:
    """The pins a colibrì PIN file can carry, and their bytes.

    Parameters
    ----------
    plan : replay.formats.planfile.Plan
        The plan the pins belong to (its geometry names the MTP layers and each layer's expert bytes).
    experts : iterable of (int, int)
        Pins as (layer, expert).

    Returns
    -------
    tuple of (list of (int, int), int)
        The pins outside MTP layers (colibrì's GLM engine pins only layers below
        num_hidden_layers), in the order given, and their bytes.
    """
    mtp = set(plan.geometry.mtp_layers)
    kept = [(layer, e) for layer, e in experts if layer not in mtp]
    size = sum(int(plan.geometry.expert_bytes[layer]) for layer, _ in kept)
    return kept, size


def container_split(container, plan, name: str):
    """The split state a measured container needs: None when it stores whole experts.

    Parameters
    ----------
    container : containers.container.Container
        The container measured.
    plan : replay.formats.planfile.Plan or None
        The plan it was rewritten from.
    name : str
        The container as the user named it (the error names it so).

    Returns
    -------
    tuple of (containers.layout.Layout, split state) or None
        The plan's segmented layout and its split state (:meth:`replay.formats.planfile.Plan.split_state`).

    Raises
    ------
    containers.errors.InputError
        When the container stores split segments and ``plan`` is not the split plan of a
        segmented layout.
    """
    if not any(e.segments for e in container.experts.values()):
        return None
    if plan is None or not plan.split or not plan.layout.segmented:
        raise InputError(name, "this container stores experts as split segments; give --layout PLAN.json, "
                               "the split plan it was rewritten from")
    return plan.layout, plan.split_state()
