"""A model configuration in words: which read path it models, colibrì's or relayout's own, and how.

:func:`describe` is the one line every output prints for the configuration a prediction is of
(the ``read path:`` line, gate.json); :func:`describe_mode` the clause naming how the model runs a
colibrì configuration (:func:`replay.colibri.engine_config.model_config`). Sizes in GB, rates in GB/s.
"""

from __future__ import annotations

from replay.model.config import RuntimeConfig


def describe(config: RuntimeConfig) -> str:
    """One line naming the read path a configuration models: colibrì's variables, or relayout's own
    read path, and what of it needs a runtime change."""
    if config.engine_env:
        lru = (f"LRU cap {config.lru_experts}/layer" if config.lru_experts >= 0 else
               f"LRU from --ram-gb {config.ram_bytes / 1e9:g} (give CAP or RAM_GB for the engine's own sizing)")
        head = f"colibrì {config.engine_env} ({describe_mode(config)}); {lru}"
    else:
        mode = "batched queue (64 in flight)" if config.batched else f"{config.workers} loader workers"
        head = f"relayout's read path: {mode}, {'O_DIRECT' if config.direct else 'buffered'} weights"
    if not config.direct:
        head += (f"; page cache for weights {config.page_cache_bytes / 1e9:g} GB" if config.page_cache_bytes else
                 "; no page cache for weights (every buffered weight read reaches the drive; --page-cache-gb)")
    head += f"; expert matmuls at {config.compute_bytes_per_second / 1e9:g} GB/s of weights"
    if config.cpu_cores:
        head += f"; page-cache copies at most {config.copy_slots} at once"
        if config.team_held_cores:
            head += (f" (the {config.cpu_cores} cores less the {config.team_held_cores} the OpenMP team keeps from them; "
                     "beside the matmuls only on the cores those leave)")
        elif config.copy_threads and config.copy_threads < config.copy_cores:
            head += f" (URING's io-wq copies on {config.copy_threads} thread, beside the matmuls on {config.cpu_cores} cores)"
        else:
            head += " (the cores)"
    if config.runtime_changes:
        head += " | NEEDS A RUNTIME CHANGE: " + "; ".join(config.runtime_changes)
    return head


def describe_mode(config: RuntimeConfig) -> str:
    """How the model runs a colibrì configuration, in words."""
    if config.blocking:
        mode = f"PIPE=0: blocking batch on a team of {config.workers}"
    elif config.batched:
        mode = "URING=1: one submission, up to 64 loads in flight, waits per expert"
    else:
        mode = f"PIPE=1: {config.workers} loader threads, waits per expert"
        if config.loaders_on_compute_core:
            mode += " (on the compute thread's core: each block of loads waits the device profile's loader handoff)"
    if config.prefetch == "pilot" and config.prefetch_hints:
        mode += (f", PILOT=1: page-cache hints for the router pilot's {config.prefetch_experts} experts per position of "
                 f"the next layer, {config.pilot_precision:.0%} of them right (drawn: its predictions are in no trace)")
    elif config.prefetch == "pilot":
        mode += (f", PILOT_REAL: the router pilot loads {config.prefetch_experts} experts per position of the next layer "
                 f"on {config.pilot_workers} thread{'s' if config.pilot_workers > 1 else ''}, "
                 f"{config.pilot_precision:.0%} of them right (drawn: its predictions are in no trace)"
                 f"{', eviction guard on' if config.evict_guard else ''}, each layer waiting for the loads in flight on it"
                 f"{' (its io_uring batches taken as its loads in turn)' if config.batched else ''}")
    elif config.prefetch == "coupled" and config.prefetch_hints:
        mode += f", COUPLE: page-cache hints for the {config.prefetch_experts} best of the pair table {config.couple_file}"
    if config.prefetch == "pilot" and config.couple_file:
        mode += f", COUPLE: then the {config.couple_experts} best of the pair table {config.couple_file} per position"
    if config.mapped_views:
        return (f"{mode}, COLI_MMAP=1: experts as mapped views (a page-cache hit re-touches mapped pages, "
                f"at the rate the run's decode loads took), routing order")
    return f"{mode}, {'O_DIRECT' if config.direct else 'buffered'} weights, routing order"
