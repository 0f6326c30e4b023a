"""Routing traces: the canonical file, every importer, synthetic generation and statistics."""

import json
import struct

import numpy as np
import pytest
import zstandard
from conftest import ROUTE, cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from containers.errors import InputError
from relayout.planning.coactivation import pair_counts, write_coli_pairs
from relayout.traces.importer import import_traces
from relayout.traces.route import read_route_trace
from relayout.traces.stats import layer_rows_in_turn, reuse_distances, trace_stats
from relayout.traces.synth import fit_atlas, load_atlas, synth_trace
from replay.formats.trace import load_trace, save_trace
from replay.model.routing import FORWARD_KINDS


def test_route_trace_forwards_kinds_and_rows(tmp_path):
    p = tmp_path / "a.route"
    p.write_text(ROUTE)
    tr, warn = import_traces([p])
    assert warn == []
    assert tr.n_forwards == 3
    assert [FORWARD_KINDS[k] for k in tr.fwd_kind] == ["prefill", "decode", "decode"]
    assert tr.fwd_evaluated.tolist() == [2, 1, 1] and tr.fwd_committed.tolist() == [1, 1, 1]  # prefill commits its first token
    assert tr.layers.tolist() == [3, 4] and tr.top_k == 2 and tr.n_experts == 8
    # rows sorted by forward, layer, position; selection order kept
    assert tr.experts.tolist() == [[5, 1], [2, 5], [7, 0], [1, 2], [5, 6], [0, 3], [4, 5], [1, 2]]
    assert tr.gates[0].tolist() == pytest.approx([0.5, 0.25])


def test_fast_and_careful_route_parsers_agree(tmp_path):
    a = tmp_path / "a.route"
    b = tmp_path / "b.route"
    a.write_text(ROUTE)
    b.write_text("# comment\n" + ROUTE.replace(" 5:0.5000", "  5:0.5") + "\n\n")
    ta, _ = import_traces([a])
    tb, _ = import_traces([b])
    assert ta.experts.tolist() == tb.experts.tolist()
    assert np.allclose(ta.gates, tb.gates)
    assert ta.fwd_kind.tolist() == tb.fwd_kind.tolist()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 30), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_route_round_trip_property(tmp_path, forwards, k, seed):
    rng = np.random.default_rng(seed)
    lines, truth = [], []
    call = 0
    for f in range(forwards):
        for layer in (3, 4, 5):
            ids = rng.choice(16, size=k, replace=False)
            g = rng.random(k)
            lines.append(f"{call} 0 {layer} " + " ".join(f"{e}:{x:.4f}" for e, x in zip(ids, g)))
            truth.append(ids.tolist())
            call += 1
    p = tmp_path / "r.route"
    p.write_text("\n".join(lines) + "\n")
    tr, _ = import_traces([p])
    assert tr.n_forwards == forwards
    assert tr.experts.tolist() == truth


def route_text(rng, forwards: int, widths=(1, 2, 3)) -> str:
    """A ROUTE_TRACE with prefill and decode forwards, rows of varying width, comments, blank and CRLF lines."""
    lines, call = [], 0
    for f in range(forwards):
        positions = 3 if f == 0 else 1
        for layer in (3, 4):
            for row in range(positions):
                k = int(rng.choice(widths))
                sel = " ".join(f"{e}:{g:.{int(rng.integers(1, 6))}f}" for e, g in zip(rng.choice(16, k, replace=False), rng.random(k)))
                lines.append(f"{call} {row} {layer} {sel}" + ("\r" if rng.random() < 0.1 else ""))
                if rng.random() < 0.05:
                    lines.append("# a comment" if rng.random() < 0.5 else "")
            call += 1
    return "\n".join(lines) + "\n"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**31 - 1), st.integers(1, 400), st.booleans())
def test_route_import_in_blocks_is_the_import_in_one_block(tmp_path, seed, block, compressed):
    rng = np.random.default_rng(seed)
    text = route_text(rng, int(rng.integers(1, 40)), widths=(2,) if rng.random() < 0.5 else (1, 2, 3)).encode()
    p = tmp_path / "r.route"
    p.write_bytes(zstandard.ZstdCompressor().compress(text) if compressed else text)
    whole = read_route_trace(p, block_bytes=1 << 30)
    parts = read_route_trace(p, block_bytes=block)
    for name in ("forward", "layer", "position", "experts", "fwd_kind", "fwd_evaluated", "fwd_committed"):
        assert np.array_equal(getattr(parts, name), getattr(whole, name)), name
    assert np.array_equal(parts.gates, whole.gates, equal_nan=True)
    assert parts.experts.dtype == np.int16 and parts.layer.dtype == np.int16 and parts.position.dtype == np.int32


def test_route_errors_in_blocks_name_the_whole_files_line(tmp_path):
    good = "".join(f"{i} 0 3 1:0.5 2:0.25\n" for i in range(50))
    p = tmp_path / "late.route"
    p.write_text(good + "50 0 3 1:0.5 9999:0.5\n" + good.replace("0 3", "0 4"))
    for block in (16, 64, 1 << 20):
        with pytest.raises(InputError, match="late.route:51"):
            read_route_trace(p, block_bytes=block)
    # a malformed line is reported before a value out of range on an earlier line, as in one block
    p.write_text("0 0 3 1:0.5 9999:0.5\n" + good + "51 0 3 1:0.5 2:x\n")
    for block in (16, 1 << 20):
        with pytest.raises(InputError, match="late.route:52.*not a number"):
            read_route_trace(p, block_bytes=block)
    p.write_text("# only a comment\n\n")
    with pytest.raises(InputError, match="no routing lines"):
        read_route_trace(p, block_bytes=8)


def test_malformed_route_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.route"
    p.write_text(ROUTE + "6 0 3 x:0.1 2:0.2\n")
    with pytest.raises(InputError) as exc:
        import_traces([p])
    assert str(exc.value).startswith(f"{p}:9:")
    res = cli("trace", "import", p, "-o", tmp_path / "o.rt")
    assert res.returncode == 2 and f"{p.name}:9" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "o.rt").exists()


def test_duplicate_expert_in_a_row_is_refused(tmp_path):
    p = tmp_path / "dup.route"
    p.write_text("0 0 3 1:0.5 1:0.4\n")
    with pytest.raises(InputError, match=":1: an expert is selected twice"):
        import_traces([p])


def test_several_files_are_several_sessions(tmp_path):
    paths = []
    for i in range(3):
        p = tmp_path / f"s{i}.route"
        p.write_text(ROUTE)
        paths.append(p)
    tr, _ = import_traces(paths)
    assert tr.sessions == ["s0.route", "s1.route", "s2.route"]
    assert tr.fwd_session.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def stall_records():
    recs = []
    for step in range(3):
        recs.append({"record": "step", "run_id": "r", "request_id": 1, "step": step, "evaluated_positions": 2, "committed_tokens": 1 + step % 2})
        for layer in (3, 4):
            for e in (step, step + 1):
                recs.append({"run_id": "r", "request_id": 1, "step": step, "layer": layer, "expert_id": e,
                             "required": True, "router_probability": 0.1 * (e + 1), "issue_ns": 0, "ready_ns": 1})
            recs.append({"run_id": "r", "request_id": 1, "step": step, "layer": layer, "expert_id": 9, "required": False})
    return recs


@pytest.mark.parametrize("compressed", [False, True])
def test_stall_trace_import(tmp_path, compressed):
    text = "\n".join(json.dumps(r) for r in stall_records()) + "\n"
    p = tmp_path / ("s.jsonl.zst" if compressed else "s.jsonl")
    p.write_bytes(zstandard.ZstdCompressor().compress(text.encode()) if compressed else text.encode())
    tr, _ = import_traces([p])
    assert tr.n_forwards == 3
    assert tr.fwd_evaluated.tolist() == [2, 2, 2] and tr.fwd_committed.tolist() == [1, 2, 1]
    assert sorted(tr.experts[0].tolist()) == [0, 1]
    assert 9 not in tr.experts  # not required: not routing


def test_stall_trace_bad_record(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps({"step": 0, "layer": 3, "expert_id": 1}) + "\n{not json\n")
    with pytest.raises(InputError, match=r"s\.jsonl:2: not JSON"):
        import_traces([p])


def mblt_bytes(records, n_expert=16):
    out = struct.pack("<III", 0x544C424D, 1, n_expert)
    for layer, ids in records:
        ids = np.asarray(ids, dtype="<i4")
        out += struct.pack("<III", layer, ids.shape[1], ids.shape[0]) + ids.tobytes()
    return out


def test_mblt_import_tolerates_torn_last_record(tmp_path):
    recs = [(0, [[1, 2], [3, 4]]), (1, [[5, 6], [7, 8]]), (0, [[1, 3]]), (1, [[2, 4]])]
    data = mblt_bytes(recs)
    p = tmp_path / "t.mblt"
    p.write_bytes(data + struct.pack("<III", 0, 2, 5) + b"\x01\x00")
    tr, warn = import_traces([p])
    assert any("torn" in w for w in warn)
    assert tr.n_forwards == 2 and tr.fwd_evaluated.tolist() == [2, 1]
    assert tr.experts.tolist() == [[1, 2], [3, 4], [5, 6], [7, 8], [1, 3], [2, 4]]
    assert tr.n_experts == 16


def test_mblt_bad_ids(tmp_path):
    p = tmp_path / "t.mblt"
    p.write_bytes(mblt_bytes([(0, [[1, 99]])]))
    with pytest.raises(InputError, match="record 1"):
        import_traces([p])


def test_coli_usage_is_heat_only_and_says_so(tmp_path):
    p = tmp_path / "x.coli_usage"
    p.write_text("-1 2 8\n-2 1 7\n3 1 10\n3 2 5\n4 7 1\n")
    tr, warn = import_traces([p])
    assert tr.heat_only and any("heat only" in w for w in warn)
    assert tr.expert_heat()[0, 1] == 10 and tr.expert_heat()[1, 7] == 1
    out = tmp_path / "x.rt"
    save_trace(tr, out)
    assert load_trace(out).heat_only
    with pytest.raises(InputError, match="heat only"):
        write_coli_pairs(tr, tmp_path / "p")
    assert "no co-activation" in cli("trace", "stats", out).stdout


def test_trace_file_round_trip_and_corruption(tmp_path):
    tr = synth_trace([3, 4, 5], 32, 4, 300, 3, seed=5)
    p = tmp_path / "t.rt"
    save_trace(tr, p)
    back = load_trace(p)
    for name in ("row_forward", "row_layer", "experts", "gates", "fwd_session", "fwd_committed"):
        assert np.array_equal(getattr(tr, name), getattr(back, name), equal_nan=True)
    assert back.fingerprint() == tr.fingerprint() and back.sessions == tr.sessions
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=str(p)):
        load_trace(p)
    (tmp_path / "junk").write_bytes(b"hello world, not a trace")
    with pytest.raises(InputError, match="not a relayout trace"):
        load_trace(tmp_path / "junk")


def test_gates_stay_in_the_file_until_used_and_are_verified_then(tmp_path):
    tr = synth_trace([3, 4, 5], 32, 4, 300, 3, seed=6)
    p = tmp_path / "t.rt"
    save_trace(tr, p)
    lazy = load_trace(p)
    assert "gates" not in {k.lstrip("_") for k, v in vars(lazy).items() if isinstance(v, np.ndarray)}
    assert np.array_equal(lazy.gates, tr.gates, equal_nan=True)              # read on first use
    assert np.array_equal(load_trace(p, gates=True).gates, tr.gates, equal_nan=True)
    assert load_trace(p).subset([1]).gates.shape == tr.subset([1]).gates.shape
    # the file damaged after loading: the first use of the gates says so, in one line
    later = load_trace(p)
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(InputError, match="checksum mismatch|changed since"):
        later.gates


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.permutations(range(4)))
def test_a_sessions_fingerprint_is_its_content_wherever_it_sits(seed, order):
    tr = synth_trace([3, 4], 16, 2, 40, 4, seed=seed % 1000)
    tr.fwd_session = np.asarray(order, dtype=np.int32)[tr.fwd_session]       # session blocks in any order
    prints = tr.session_fingerprints()
    assert len(set(prints)) == 4
    for si in range(4):
        alone = tr.subset([si])
        alone.sessions = ["renamed"]
        assert alone.session_fingerprints() == [prints[si]]


def test_interleaved_sessions_are_refused(tmp_path):
    # the replay model starts each session with a cold cache: a session must be one run of forwards
    tr = synth_trace([3], 16, 2, 30, 3, seed=1)
    tr.validate()
    tr.fwd_session[[0, 15]] = tr.fwd_session[[15, 0]]
    with pytest.raises(InputError, match="not contiguous"):
        tr.validate()


def test_synth_trace_is_deterministic_and_structured():
    a = synth_trace([3, 4], 64, 8, 500, 4, seed=1)
    b = synth_trace([3, 4], 64, 8, 500, 4, seed=1)
    c = synth_trace([3, 4], 64, 8, 500, 4, seed=2)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    assert all(len(set(r)) == 8 for r in a.experts.tolist())
    s = trace_stats(a)
    assert s["summary"]["heat_entropy_bits_median"] < np.log2(64)
    assert s["summary"]["lift_p99"] > 2.0  # cliques make some pairs far likelier than chance


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 6))
def test_pair_counts_match_brute_force(seed, k):
    rng = np.random.default_rng(seed)
    rows = np.array([rng.choice(10, size=k, replace=False) for _ in range(30)])
    rows[0, -1] = -1
    C = pair_counts(rows, 10)
    brute = np.zeros((10, 10), dtype=np.int64)
    for r in rows:
        r = [x for x in r if x >= 0]
        for i in r:
            for j in r:
                if i != j:
                    brute[i, j] += 1
    assert np.array_equal(C, brute)


def test_stats_take_the_layers_in_turn_with_the_next_layers_rows():
    tr = synth_trace([3, 4, 6, 7], 16, 2, 50, 2, seed=2)
    seen = []
    for layer, rows, following in layer_rows_in_turn(tr):
        assert (tr.row_layer[rows] == layer).all() and (np.diff(rows) > 0).all()
        if layer + 1 in (4, 7):
            assert np.array_equal(following, np.flatnonzero(tr.row_layer == layer + 1))
        else:
            assert following is None                       # 4 -> 6 and 7 are not consecutive layers
        seen.append(rows)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(tr.n_rows))


def test_stats_counted_in_blocks_are_the_stats_counted_at_once(monkeypatch):
    tr = synth_trace([3, 4, 5, 7], 32, 4, 300, 3, seed=4)
    whole = trace_stats(tr, min_count=2)
    monkeypatch.setattr("relayout.traces.stats.PAIR_BLOCK_ROWS", 29)
    assert trace_stats(tr, min_count=2) == whole
    assert any(l["pairs_supported"] for l in whole["layers"]) and "cross_layer_lift" in whole["layers"][0]


def test_reuse_distance_counts_forwards_between_uses():
    tr = synth_trace([3], 16, 2, 50, 1, seed=0)
    d = reuse_distances(tr, 3)
    rows = tr.experts.tolist()
    brute = []
    last = {}
    for f, r in enumerate(rows):
        for e in r:
            if e in last:
                brute.append(f - last[e])
            last[e] = f
    assert sorted(d.tolist()) == sorted(brute)


def test_coli_pairs_format(tmp_path):
    tr = synth_trace([3, 4, 5], 16, 4, 200, 2, seed=3)
    out = tmp_path / "t.coli_pairs"
    n = write_coli_pairs(tr, out)
    lines = out.read_text().splitlines()
    assert lines[0] == f"COLIPAIRS 1 {n}" and len(lines) == n + 1
    for line in lines[1:]:
        parts = line.split()
        L, dL, e = map(int, parts[:3])
        assert dL in (1, 2) and L + dL <= 5 and 1 <= len(parts) - 3 <= 16
        counts = [int(p.split(":")[1]) for p in parts[3:]]
        assert counts == sorted(counts, reverse=True) and min(counts) > 0
    # the first target of (3, 1, e) is the count of the commonest follower, checked by hand
    first = lines[1].split()
    L, dL, e = map(int, first[:3])
    rows3 = tr.experts[tr.row_layer == L]
    rows4 = tr.experts[tr.row_layer == L + dL]
    follow = np.bincount(rows4[(rows3 == e).any(axis=1)].ravel(), minlength=16)
    assert int(first[3].split(":")[1]) == follow.max()


def test_fit_to_the_glm_atlas_reports_a_small_error():
    atlas = load_atlas("glm-5.2")  # shipped in manifests/atlases
    params, report = fit_atlas(atlas, seed=0, layer_sample=4)
    syn_med, atlas_med = report.lift_median
    assert abs(syn_med / atlas_med - 1) < 0.1
    assert report.entropy_error_bits < 0.6
    assert 0 < params.clique_strength < 0.97
