"""Fuzzed plan files: any edit (with the unkeyed digest recomputed) is either a valid plan or one
InputError, at load and at rewrite; a rewrite never writes outside its destination."""

import json
import os

import pytest
from conftest import fuzz_examples, small_geometry, source_with_manifest, tree_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from containers.errors import InputError
from relayout.workflows.apply import apply_plan, output_files, verify
from relayout.planning.packing import PackOptions
from relayout.planning.plan import make_plan, source_from_container
from relayout.traces.synth import synth_trace
from replay.formats.planfile import load_plan, plan_digest

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("planfuzz")
    g = small_geometry(moe_layers=1, experts=8, ffn=64, hidden=256, vocab=64)
    src = source_with_manifest(root / "src", g, seed=4)
    tr = synth_trace(g.moe_layers, 8, 8, 120, 3, seed=2, geometry=g.name)
    plan = make_plan(tr, source_from_container(src), pack=PackOptions(shard_bytes=400_000), progress=False)
    return dict(root=root, src=src, plan=plan, paths=list(_paths(plan)))


def _paths(obj, prefix=()):
    """Every location in a JSON document (the digest excepted)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if prefix == () and k == "plan_digest":
            continue
        yield prefix + (k,)
        yield from _paths(v, prefix + (k,))


def _edited(base, index: int, value, delete: bool) -> dict:
    plan = json.loads(json.dumps(base["plan"]))
    path = base["paths"][index % len(base["paths"])]
    parent = plan
    for k in path[:-1]:
        parent = parent[k]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    plan["plan_digest"] = plan_digest(plan)
    return plan


def _write(tmp, plan) -> str:
    path = tmp / "fuzzed.json"
    path.write_text(json.dumps(plan))
    return str(path)


@settings(max_examples=fuzz_examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(index=st.integers(min_value=0), value=JSON_VALUES, delete=st.booleans())
def test_a_fuzzed_plan_loads_or_is_one_input_error(fuzz_base, tmp_path_factory, index, value, delete):
    path = _write(tmp_path_factory.mktemp("f"), _edited(fuzz_base, index, value, delete))
    try:
        plan = load_plan(path)
        output_files(plan)
    except InputError:
        pass


@settings(max_examples=fuzz_examples(50), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(index=st.integers(min_value=0), value=JSON_VALUES, delete=st.booleans())
def test_a_fuzzed_plan_rewrites_identically_or_writes_nothing(fuzz_base, tmp_path_factory, index, value, delete):
    work = tmp_path_factory.mktemp("w")
    path = _write(work, _edited(fuzz_base, index, value, delete))
    before_src = tree_state(fuzz_base["src"])
    before = {str(p) for p in work.parent.iterdir()}
    dst = work / "dst"
    try:
        apply_plan(fuzz_base["src"], load_plan(path), dst, force=True, progress=False)
    except InputError:
        assert not dst.exists()
    else:
        assert verify(fuzz_base["src"], dst, full=True, progress=False)[0] == []
    assert sorted(os.listdir(work)) in (["fuzzed.json"], ["dst", "fuzzed.json"], ["dst.partial", "fuzzed.json"])
    assert {str(p) for p in work.parent.iterdir()} == before
    assert tree_state(fuzz_base["src"]) == before_src
