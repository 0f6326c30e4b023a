"""The model against what the runtime is known to do.

* colibrì's COALESCE change (pull request 1398 in JustVugg/colibri: one pread for experts
  contiguous in the same shard within a miss batch) measured decode 50.9 s -> 43.6 s on the stock
  GLM-5.2 container at ``--ram 8``, ``PIPE=1 DIRECT=1``: the model's coalescing prediction on the
  stock layout must have that sign on every shipped profile.
* Whole 19 MB experts at 8 workers without coalescing: reordering has no headroom on the RAID
  profiles (the drives are saturated whatever the order), and the gate must say so.
"""

import numpy as np
import pytest

from containers.geometry import load_geometry
from relayout.planning.plan import make_plan, source_from_geometry
from relayout.traces.synth import SynthParams, synth_trace
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.evaluation.gate import compare, run_layout
from replay.formats.planfile import load_plan, save_plan

PROFILES = ("mac-pro-2019-applraid-4x", "linux-md-raid0-4x", "single-nvme")
RAID_PROFILES = PROFILES[:2]


@pytest.fixture(scope="module")
def glm():
    g = load_geometry("glm-5.2-int4-row")
    trace = synth_trace(g.moe_layers, 256, 8, 120, 12, seed=3, params=SynthParams(clique_strength=0.9))
    return g, trace, source_from_geometry(g)


@pytest.mark.parametrize("profile", PROFILES)
def test_coalescing_the_stock_layout_has_the_runtimes_sign(glm, profile):
    g, trace, source = glm
    stock = source.stock
    mask = np.ones(trace.n_forwards, dtype=bool)
    pins = np.zeros((len(stock.layers), stock.n_experts), dtype=bool)
    S = {}
    for coalesce in (False, True):
        config = RuntimeConfig(workers=8, direct=True, coalesce=coalesce, ram_bytes=8 * 10**9)
        S[coalesce] = run_layout("stock", trace, mask, stock, load_device(profile), config, pins).summary.stall_per_token_s
    assert S[True] < S[False], S


@pytest.fixture(scope="module")
def glm_plan(glm, tmp_path_factory):
    """The planned layout of the whole GLM container for the ``glm`` trace, through its file."""
    g, trace, source = glm
    path = tmp_path_factory.mktemp("glm-plan") / "plan.json"
    save_plan(make_plan(trace, source, progress=False), path)
    return load_plan(path)


@pytest.mark.slow
@pytest.mark.parametrize("profile", RAID_PROFILES)
def test_reordering_whole_glm_experts_at_8_workers_has_no_headroom_on_raid(glm, glm_plan, profile):
    g, trace, source = glm
    gate = compare(glm_plan, trace, load_device(profile), RuntimeConfig(workers=8), min_sessions=3).to_json()
    assert gate["verdict"] != "pass"
    assert "No headroom" in gate["reason"], gate["reason"]
    assert abs(gate["saving_fraction_of_tpot"]["estimate"]) < 0.02
