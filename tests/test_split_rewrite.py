"""Vertical split segments: exact slicing and reassembly, and a split plan rewritten and verified."""


import numpy as np
import pytest
from conftest import cli, small_geometry, source_with_manifest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from containers.container import Container
from containers.errors import InputError
from containers.geometry import ExpertFormat
from containers.segments import SegmentSpec, expert_segment_specs, reassembled_chunks
from relayout.workflows.apply import apply_plan, verify
from relayout.planning.plan import SplitOptions, make_plan, source_from_container
from relayout.traces.synth import synth_trace
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.evaluation.gate import compare
from replay.formats.planfile import load_plan, save_plan
from replay.formats.trace import save_trace


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 40), row_bytes=st.integers(1, 64), frac=st.floats(0, 1), kind=st.sampled_from(["rows", "columns", "shared"]),
       seed=st.integers(0, 2**31 - 1))
def test_segments_slice_and_reassemble_exactly(tmp_path, rows, row_bytes, frac, kind, seed):
    data = np.random.default_rng(seed).integers(0, 256, size=rows * row_bytes, dtype=np.uint8).tobytes()
    path = tmp_path / "m.bin"
    path.write_bytes(b"HEAD" + data)
    split = None if kind == "shared" else int(frac * (rows if kind == "rows" else row_bytes))
    spec = SegmentSpec(kind, rows, row_bytes, split)
    parts = {p: b"".join(bytes(c) for c in spec.source(p, path, 4).chunks()) for p in ("top", "bottom")}
    assert len(parts["top"]) == spec.nbytes("top") and len(parts["bottom"]) == spec.nbytes("bottom")
    matrix = np.frombuffer(data, dtype=np.uint8).reshape(rows, row_bytes)
    if kind == "columns":
        assert parts["top"] == matrix[:, :split].tobytes() and parts["bottom"] == matrix[:, split:].tobytes()
    seg = tmp_path / "seg.bin"
    seg.write_bytes(parts["top"] + parts["bottom"])
    rebuilt = b"".join(reassembled_chunks(spec, seg, 0, seg, len(parts["top"]), block_rows=3))
    assert rebuilt == data


def test_segment_specs_partition_the_weights():
    for fmt in ("int4-row", "int4-g64", "int8-row"):
        f = ExpertFormat.parse(fmt)
        specs = expert_segment_specs(f, 6144, 2048, 512)
        weights = sum(s.nbytes("top") + s.nbytes("bottom") for (p, scale), s in specs.items() if not scale)
        assert weights == 3 * f.weight_bytes(2048, 6144)
        assert specs[("down", False)].kind == "columns" and specs[("gate", False)].kind == "rows"


@pytest.fixture(scope="module")
def split_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    g = small_geometry(moe_layers=2, experts=16, ffn=256)
    src = source_with_manifest(root / "src", g, seed=3)
    tr = synth_trace(g.moe_layers, 16, 8, 600, 4, seed=1, geometry=g.name)
    save_trace(tr, root / "t.rt")
    path = root / "plan.json"
    save_plan(make_plan(tr, source_from_container(src), split=SplitOptions(0.25, 900_000), progress=False), path)
    return root, src, tr, load_plan(path)


def test_split_plan_rewrites_and_verifies(split_case, tmp_path):
    root, src, tr, plan = split_case
    assert plan.layout.segmented and plan.split.resident_bytes > 0
    gate = compare(plan, tr, load_device("single-nvme"), RuntimeConfig(ram_bytes=4_000_000, workers=2))
    assert gate.plan_metrics.stall_per_token_s > 0
    dst = tmp_path / "dst"
    m = apply_plan(src, plan, dst, gate, force=True, progress=False)
    assert m["segments"] and all(v["top"].endswith(".top") for v in m["segments"].values())
    problems, summary = verify(src, dst, full=True, progress=False)
    assert problems == [] and summary["split_tensors"] == len(m["segments"]) == 3 * 6 * 16
    c = Container.open(dst)
    assert c.problems == [] and all(e.fast_path and e.segments for e in c.experts.values())
    name = "model.layers.4.mlp.experts.5.down_proj.weight"
    t = m["tensors"][name + ".bottom"]
    with open(dst / t["file"], "r+b") as fh:
        fh.seek(t["offset"] + 3)
        b = fh.read(1)
        fh.seek(t["offset"] + 3)
        fh.write(bytes([b[0] ^ 1]))
    problems, _ = verify(src, dst, progress=False)
    assert any(p.startswith(f"tensor {name} ") and "reassemble" in p for p in problems)


def test_a_split_container_says_plainly_it_needs_a_split_aware_runtime(split_case, tmp_path):
    root, src, tr, plan = split_case
    dst = tmp_path / "dst"
    apply_plan(src, plan, dst, None, force=True, progress=False)
    res = cli("verify", src, dst, "--full")
    assert res.returncode == 0 and "only a split-aware runtime can load it" in res.stdout, res.stdout + res.stderr
    res = cli("inspect", dst)
    assert "NEEDS A SPLIT-AWARE RUNTIME: 48 experts" in res.stdout, res.stdout
    assert "SPLIT-AWARE" not in cli("inspect", src).stdout


def test_measure_reads_a_split_container_as_the_plan_says(split_case, tmp_path):
    """A real split container, measured for real: resident-top misses read exactly their bottom
    segments, the others their whole blocks; the bytes per miss match the plan's segment sizes."""
    import json

    from replay.physical.measure import measure

    root, src, tr, plan = split_case
    dst = tmp_path / "dst"
    apply_plan(src, plan, dst, None, force=True, progress=False)
    c = Container.open(dst)
    state = plan.split_state()
    mask = np.zeros(tr.n_forwards, bool)
    mask[:40] = True
    out = tmp_path / "run.jsonl"
    cfg = RuntimeConfig(workers=2, direct=False, dense_seconds=0.0)      # buffered: bytes read are exactly the planned ones
    res = measure(c, tr, mask, cfg, out, progress=False, split=(plan.layout, state))
    recs = [json.loads(x) for x in out.read_text().splitlines() if '"record":"step"' not in x]
    assert res.steps == 40 and recs
    segs = plan.split.segments
    seen = {True: 0, False: 0}
    for r in recs:
        li = plan.layout.layers.index(r["layer"])
        resident = bool(state.resident[li, r["expert_id"]])
        s = segs[r["layer"]]
        read = r["drive_bytes"] + r["page_cache_bytes"] + r["unclassified_bytes"]
        reads = r["drive_requests"] + r["page_cache_requests"] + r["unclassified_requests"]
        if resident:
            assert read == r["bytes"] == s.bottom_bytes and reads == 1 + 3
        else:
            assert read == r["bytes"] == s.top_bytes + s.bottom_bytes and reads == 1 + 6
        seen[resident] += 1
    assert seen[True] and seen[False]               # both kinds of miss were measured
    with pytest.raises(InputError, match="split segments"):
        measure(c, tr, mask, cfg, None, progress=False)
    with pytest.raises(InputError, match="not implemented"):
        measure(c, tr, mask, RuntimeConfig(workers=2, coalesce=True), None, progress=False, split=(plan.layout, state))
    res = cli("measure", "--container", dst, "--trace", root / "t.rt", "--layout", root / "plan.json", "--buffered",
              "--tokens", "5", "--workers", "2", "-o", tmp_path / "cli.jsonl")
    assert res.returncode == 0, res.stderr


def test_model_and_harness_plan_the_same_bytes_for_split_misses(split_case, tmp_path):
    """The replay model's read plan and the harness's split reads: the same weight bytes for every
    miss, and for group-scale formats the same bytes in all (per-row down scales are stored twice,
    which the model does not count: see replay.physical.read_jobs.SplitReads)."""
    from containers.geometry import ExpertFormat
    from replay.model.engine import layout_arrays
    from replay.physical.read_jobs import SplitReads
    from replay.model.readplan import WEIGHT, Coalescing, LayerPlace, new_plan, plan_layer

    root, src, tr, plan = split_case
    dst = tmp_path / "dst"
    apply_plan(src, plan, dst, None, force=True, progress=False)
    state = plan.split_state()
    seg = SplitReads(Container.open(dst), plan.layout, state)
    lay = layout_arrays(plan.layout, RuntimeConfig(), state)
    grouped = 0
    for li, layer in enumerate(plan.layout.layers):
        group = ExpertFormat.parse(plan.geometry.expert_formats[layer]).group is not None
        for e in range(plan.layout.n_experts):
            p = new_plan(1)
            place = LayerPlace(keep=1 - state.top_fraction[li], adjacent=lay.adjacent[li], pos_file=lay.pos_file[li],
                               pos_off=lay.pos_off[li], wbytes=lay.wbytes[li], wloc=lay.wloc[li], sloc=lay.sloc[li])
            n, _ = plan_layer(np.array([e]), 1, np.zeros(1, bool), np.array([state.resident[li, e]]), place,
                              Coalescing(coalesce=False, gap_bytes=0, max_bytes=1 << 30), np.empty(1, np.int64), p)
            model = [(int(p.kind[i]), int(p.length[i])) for i in range(n)]
            real = [(kind, length) for _, _, length, kind in seg.reads(li, e)]
            assert [x for x in model if x[0] == WEIGHT] == [x for x in real if x[0] == WEIGHT]
            if group:
                assert sum(x[1] for x in model) == sum(x[1] for x in real) == seg.need_bytes[li, e]
                grouped += 1
    assert grouped
