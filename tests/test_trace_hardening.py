"""Hardening of trace import, the trace file and trace stats.

Every bad input is one InputError (exit 2, one line, no traceback); nothing wraps on a narrowing
cast; nothing allocates from an unchecked header value; a trace that imports always has stats.
The property tests mutate each format at random and accept only success or InputError.
"""

import json
import struct
import tracemalloc

import numpy as np
import pytest
import xxhash
import zstandard
from conftest import ROUTE, cli, fuzz_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from containers.errors import InputError
from relayout.planning.coactivation import write_coli_pairs
from relayout.traces.importer import import_traces
from relayout.traces.stats import trace_stats
from relayout.traces.synth import synth_trace
from replay.formats.trace import MAGIC, load_trace, save_trace
from replay.model.routing import RoutingTrace


def write(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


def refused(paths, match, **kw):
    with pytest.raises(InputError, match=match) as exc:
        import_traces(paths, **kw)
    return str(exc.value)


def one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("relayout: error: ") and "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def mblt_bytes(records, n_expert=16):
    out = struct.pack("<III", 0x544C424D, 1, n_expert)
    for layer, ids in records:
        ids = np.asarray(ids, dtype="<i4")
        out += struct.pack("<III", layer, ids.shape[1], ids.shape[0]) + ids.tobytes()
    return out


MBLT_RECORDS = [(0, [[1, 2], [3, 4]]), (1, [[5, 6], [7, 8]]), (0, [[1, 3]]), (1, [[2, 4]]), (0, [[5, 9]]), (1, [[2, 3]])]


def stall_text():
    recs = []
    for step in range(3):
        recs.append({"record": "step", "run_id": "r", "request_id": 1, "step": step, "evaluated_positions": 2, "committed_tokens": 1})
        for layer in (3, 4):
            for e in (step, step + 1):
                recs.append({"run_id": "r", "request_id": 1, "step": step, "layer": layer, "expert_id": e,
                             "required": True, "router_probability": 0.1 * (e + 1)})
            recs.append({"run_id": "r", "request_id": 1, "step": step, "layer": layer, "expert_id": 9, "required": False})
    return "\n".join(json.dumps(r) for r in recs) + "\n"


def write_rt(path, header, arrays, version=2, digest=True):
    """A trace file in the documented format: magic, version, header length, digest, zstd stream."""
    raw = json.dumps(header).encode()
    fields = struct.pack("<II", version, len(raw))
    payload = zstandard.ZstdCompressor().compress(raw + b"".join(np.ascontiguousarray(a).tobytes() for a in arrays))
    head = MAGIC + fields
    if digest:
        head += xxhash.xxh3_128(fields + payload).digest()
    path.write_bytes(head + payload)
    return path


def rt_parts(trace):
    """(header, arrays) exactly as save_trace writes them."""
    from replay.model.routing import ARRAYS, DTYPES

    arrays = [(n, np.ascontiguousarray(getattr(trace, n), dtype=DTYPES[n])) for n in ARRAYS]
    if trace.heat is not None:
        arrays.append(("heat", np.ascontiguousarray(trace.heat, dtype=DTYPES["heat"])))
    header = {
        "version": 2,
        "geometry": {"name": trace.geometry, "layers": trace.layers.tolist(), "n_experts": trace.n_experts, "top_k": trace.top_k},
        "sessions": trace.sessions, "heat_only": trace.heat_only, "source": trace.source, "meta": {},
        "arrays": [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape)} for n, a in arrays],
    }
    return header, [a for _, a in arrays]


# ------------------------------------------------------------------ 1, 4: ranges before narrowing


def test_ids_and_layers_do_not_wrap_modulo_2_16(tmp_path):
    p = write(tmp_path, "wrap.route", "0 0 3 1:0.5 65538:0.5\n1 0 65540 3:0.5 4:0.5\n")
    assert refused([p], "expert id 65538")
    p = write(tmp_path, "wrapl.route", "0 0 3 1:0.5 2:0.5\n1 0 65540 3:0.5 4:0.5\n")
    assert refused([p], "layer 65540").startswith(f"{p}:2:")
    p = write(tmp_path, "l.mblt", mblt_bytes([(4294967295, [[1, 2]])]))
    assert refused([p], "layer 4294967295").startswith(f"{p}:record 1")
    p = write(tmp_path, "pos.route", "0 3000000000 3 1:0.5 2:0.5\n")
    refused([p], "position 3000000000")
    p = write(tmp_path, "big.stall.jsonl", json.dumps({"step": 0, "layer": 3, "expert_id": 2**63}) + "\n")
    refused([p], ":1: 'expert_id' must be an integer of 0 to 1048575 \\(got 9223372036854775808\\)")
    p = write(tmp_path, "wide.stall.jsonl", json.dumps({"step": 0, "layer": 3, "expert_id": 70000}) + "\n")
    refused([p], ":1: expert id 70000 is above 4095")


def test_one_large_id_is_refused_not_allocated(tmp_path):
    p = write(tmp_path, "big.route", "0 0 3 1:0.5 40000:0.5\n1 0 4 3:0.5 4:0.5\n2 0 3 1:0.5 2:0.5\n3 0 4 1:0.5 2:0.5\n")
    msg = refused([p], "expert id 40000")
    assert msg.startswith(f"{p}:1:") and "4096" in msg
    one_line_error(cli("trace", "import", p, "-o", tmp_path / "o.rt"), "big.route:1", "4096")
    # with a geometry the geometry's count bounds ids instead
    p = write(tmp_path, "g.route", "0 0 3 1:0.5 300:0.5\n")
    refused([p], "expert id 300 >= 256", n_experts=256, geometry="glm-5.2-int4-row")


def test_wrong_geometry_is_refused(tmp_path):
    # a GLM-shaped trace (layers 3..77, ids up to 255) under qwen3-30b-a3b (layers 0..47, 128 experts)
    rng = np.random.default_rng(0)
    lines = [f"{i} 0 {layer} " + " ".join(f"{e}:0.1000" for e in rng.choice(128, 8, replace=False))
             for i, layer in enumerate(range(3, 78))]
    p = write(tmp_path, "glm.route", "\n".join(lines) + "\n")
    msg = refused([p], "not a routed layer of geometry qwen3-30b-a3b", n_experts=128, geometry="qwen3-30b-a3b")
    assert msg.startswith(f"{p}:46:")  # layer 48 is the first outside 0..47
    one_line_error(cli("trace", "import", p, "--geometry", "qwen3-30b-a3b", "-o", tmp_path / "o.rt"), "layer 48")
    assert cli("trace", "import", p, "--geometry", "glm-5.2-int4-row", "-o", tmp_path / "o.rt").returncode == 0
    # explicit routed layers (a geometry file the importer cannot look up by name)
    refused([p], "layer 3 is not a routed layer", n_experts=256, geometry="custom", routed_layers=range(40, 50))


# ------------------------------------------------------------------ 3: duplicates


def test_duplicated_route_line_is_an_error_naming_it(tmp_path):
    p = write(tmp_path, "dup.route", ROUTE.splitlines()[0] + "\n" + ROUTE)
    msg = refused([p], "repeats row 0 of layer 3")
    assert msg.startswith(f"{p}:2:") and "first at line 1" in msg
    p = write(tmp_path, "dup2.route", "0 0 3 1:0.5 2:0.5\n0 1 3 1:0.5 2:0.5\n0 0 3 3:0.5 4:0.5\n1 0 4 1:0.5 2:0.5\n")
    assert refused([p], "repeats row 0").startswith(f"{p}:3:")
    # out-of-order rows of one layer are fine
    p = write(tmp_path, "ok.route", "0 1 3 1:0.5 2:0.5\n0 0 3 3:0.5 4:0.5\n1 0 4 1:0.5 2:0.5\n")
    tr, _ = import_traces([p])
    assert tr.row_position.tolist() == [0, 1, 0]


def test_repeated_mblt_layer_is_an_error(tmp_path):
    p = write(tmp_path, "d.mblt", mblt_bytes([(0, [[1, 2]]), (0, [[3, 4]]), (1, [[1, 2]])]))
    assert refused([p], "repeats layer 0").startswith(f"{p}:record 2")


def test_stats_never_index_error_on_duplicated_rows(tmp_path):
    # a trace holding a repeated (forward, layer, position), as an old importer wrote: refused on load
    tr = synth_trace([3, 4], 16, 2, 5, 1, seed=0)
    header, arrays = rt_parts(tr)
    names = [a["name"] for a in header["arrays"]]
    arrays[names.index("row_forward")][2] = arrays[names.index("row_forward")][0]
    arrays[names.index("row_layer")][2] = arrays[names.index("row_layer")][0]
    p = write_rt(tmp_path / "d.rt", header, arrays)
    with pytest.raises(InputError, match="appears twice|not sorted|forward order"):
        load_trace(p)
    one_line_error(cli("trace", "stats", p))


# ------------------------------------------------------------------ 5: MBLT torn tail only at the end


def test_mblt_damage_mid_file_is_an_error_torn_tail_is_not(tmp_path):
    data = bytearray(mblt_bytes(MBLT_RECORDS))
    struct.pack_into("<I", data, 12 + 28 + 28 + 8, 1 << 20)  # record 3 claims 2^20 tokens
    p = write(tmp_path, "dmg.mblt", bytes(data))
    msg = refused([p], "damaged mid-file")
    assert msg.startswith(f"{p}:record 3") and "byte 68" in msg
    one_line_error(cli("trace", "import", p, "-o", tmp_path / "o.rt"), "record 3", "byte 68")
    torn = mblt_bytes(MBLT_RECORDS) + struct.pack("<III", 0, 2, 5) + b"\x01\x00\x00\x00\x02\x00"
    tr, warn = import_traces([write(tmp_path, "torn.mblt", torn)])
    assert any("torn" in w for w in warn) and tr.n_rows == 8
    # damage to the last record alone cannot be told from a torn record: dropped with a warning
    data = bytearray(mblt_bytes(MBLT_RECORDS))
    struct.pack_into("<I", data, len(data) - 8 - 12 + 8, 1 << 20)
    tr, warn = import_traces([write(tmp_path, "last.mblt", bytes(data))])
    assert any("record 6 is torn" in w for w in warn)


def test_mblt_header_expert_count_is_bounded(tmp_path):
    p = write(tmp_path, "h.mblt", struct.pack("<III", 0x544C424D, 1, 2**31) + struct.pack("<IIIii", 0, 2, 1, 1, 2))
    refused([p], "header says 2147483648 experts")
    refused([p], "geometry glm-5.2-int4-row has 256", n_experts=256, geometry="glm-5.2-int4-row")


# ------------------------------------------------------------------ 6: strict types


@pytest.mark.parametrize("line, match", [
    ("0 0 3 1_0:0.5 2:0.5", "not a ROUTE_TRACE line"),
    ("0 0 3 5:inf 2:0.5", "gate 'inf'"),
    ("0 0 3 5:nan 2:0.5", "gate 'nan'"),
    ("0 0 3 5:1e999 2:0.5", "not finite"),
    ("0 0 3 5:0.5:0.2 2:0.5", "is not '<expert>:<gate>'"),
    ("0 0 3 5::0.5 2:0.5", "is not '<expert>:<gate>'"),
    ("0 0 3 5 2:0.5", "is not '<expert>:<gate>'"),
    ("0 0 3 5:0.5. 2:0.5", "gate '0.5.'"),
    ("0 0 3 5:0.5 2:0.5:", "is not '<expert>:<gate>'"),
    ("0 0 3 5:0_5 2:0.5", "gate '0_5'"),
    ("0 0 3 1234567890123456789:0.5", "more than 18 digits"),
])
def test_route_numbers_are_strict(tmp_path, line, match):
    # a regular line before it keeps the fast parser in play
    p = write(tmp_path, "s.route", "0 0 3 1:0.5 2:0.5\n" + line + "\n")
    assert refused([p], match).startswith(f"{p}:2:")


@pytest.mark.parametrize("rec, match", [
    ({"step": True, "layer": 3, "expert_id": 1}, "'step' must be an integer"),
    ({"step": 1e308, "layer": 3, "expert_id": 1}, "'step' must be an integer"),
    ({"step": 2**64, "layer": 3, "expert_id": 1}, "'step' must be an integer of 0 to 2147483647"),
    ({"step": 0, "layer": 3.0, "expert_id": 1}, "'layer' must be an integer"),
    ({"step": 0, "layer": 3, "expert_id": False}, "'expert_id' must be an integer"),
    ({"step": 0, "layer": 3, "expert_id": 1, "required": "false"}, "'required' must be true or false"),
    ({"step": 0, "layer": 3, "expert_id": 1, "required": 0}, "'required' must be true or false"),
    ({"step": 0, "layer": 3, "expert_id": 1, "router_probability": "0.5"}, "finite number"),
    ({"step": 0, "layer": 3, "expert_id": 1, "position": -1}, "'position' must be an integer of 0 to"),
    ({"step": 0, "layer": 3, "expert_id": 1, "request_id": [1]}, "'request_id' must be a string or an integer"),
    ({"step": 0, "record": "step", "evaluated_positions": True}, "'evaluated_positions' must be an integer"),
    ({"step": 0, "layer": 5000, "expert_id": 1}, "layer 5000 is above 4095"),
    ({"step": 0, "layer": 70000, "expert_id": 1}, "'layer' must be an integer of 0 to 65535"),
    ({"step": 0, "layer": 3}, "missing required field 'expert_id'"),
    ({"step": 0, "layer": 3, "expert_id": 1, "bytes": -1}, "'bytes' must be an integer of 0 to"),
])
def test_stall_types_are_strict(tmp_path, rec, match):
    p = write(tmp_path, "s.jsonl", json.dumps({"step": 0, "layer": 3, "expert_id": 2}) + "\n" + json.dumps(rec) + "\n")
    assert refused([p], match).startswith(f"{p}:2:")


def test_stall_false_required_is_skipped_and_overflow_inputs_are_errors(tmp_path):
    p = write(tmp_path, "ok.jsonl", json.dumps({"step": 0, "layer": 3, "expert_id": 2}) + "\n"
              + json.dumps({"step": 0, "layer": 3, "expert_id": 5, "required": False}) + "\n")
    tr, _ = import_traces([p])
    assert tr.experts.tolist() == [[2]]
    p = write(tmp_path, "inf.jsonl", '{"step": 0, "layer": 3, "expert_id": 1, "router_probability": 1e999}\n')
    refused([p], "finite number")
    p = write(tmp_path, "deep.jsonl", '{"step": ' + "[" * 100000 + "]" * 100000 + "}\n")
    refused([p], "deep.jsonl:1: not JSON")
    one_line_error(cli("trace", "import", p, "-o", tmp_path / "o.rt"), "deep.jsonl:1")


def test_stall_import_and_report_share_one_reader(tmp_path):
    from replay.physical.stalltrace import read_stall_trace as read_for_report

    recs = [{"record": "step", "step": 0, "evaluated_positions": 2}, {"record": "step", "step": 0},
            {"step": 0, "layer": 3, "expert_id": 1}]
    p = write(tmp_path, "twice.jsonl", "\n".join(json.dumps(r) for r in recs) + "\n")
    assert refused([p], "second step record for request 0 step 0").startswith(f"{p}:2:")
    p = write(tmp_path, "late.jsonl", json.dumps({"run_id": "r", "request_id": 0, "step": 0, "layer": 3, "expert_id": 1,
                                                  "required": True, "bytes": 8, "issue_ns": 9, "ready_ns": 5}) + "\n")
    for read in (import_traces, read_for_report):
        with pytest.raises(InputError, match="ready_ns 5 is before issue_ns 9") as exc:
            read([p]) if read is import_traces else read(p)
        assert str(exc.value).startswith(f"{p}:1:")


def test_stall_contradicting_step_records(tmp_path):
    recs = [{"record": "step", "step": 0, "evaluated_positions": 2, "committed_tokens": 1},
            {"record": "step", "step": 0, "evaluated_positions": 3, "committed_tokens": 1},
            {"step": 0, "layer": 3, "expert_id": 1}]
    p = write(tmp_path, "c.jsonl", "\n".join(json.dumps(r) for r in recs) + "\n")
    assert refused([p], "evaluated_positions 3 disagrees with 2 given at line 1").startswith(f"{p}:2:")


# ------------------------------------------------------------------ 2: .coli_usage allocations


@pytest.mark.parametrize("text, match", [
    ("-1 78 99999999999\n3 1 5\n", "header says 99999999999 experts"),
    ("-1 78 0\n3 1 5\n", "header says 0 experts"),
    ("-1 99999999999 16\n3 1 5\n", "header says 99999999999 layers"),
    ("-1 78 16\n-1 78 32\n3 1 5\n", "a second header"),
    ("-1 78 16\n3 1 99999999999999999999999\n", "more than 18 digits"),
    ("-1 78 16\n3 1 999999999999999\n", "implausibly large"),
    ("-1 78 16\n3 1 5\n3 1 6\n", "listed twice"),
    ("-1 78 16\n70000 1 5\n", "layer 70000"),
    ("-1 78 16\n3 1_0 5\n", "expected integers"),
])
def test_coli_usage_bounds(tmp_path, text, match):
    refused([write(tmp_path, "x.coli_usage", text)], match)


def test_coli_usage_count_before_header_is_checked(tmp_path):
    p = write(tmp_path, "x.coli_usage", "3 100 5\n-1 78 16\n")
    refused([p], "expert 100 >= n_experts 16", fmt="coli_usage")


def test_coli_usage_geometry_must_agree(tmp_path):
    p = write(tmp_path, "x.coli_usage", "-1 48 160\n3 1 5\n")
    refused([p], "geometry qwen3-30b-a3b has 128", n_experts=128, geometry="qwen3-30b-a3b")


# ------------------------------------------------------------------ 2, 7: the .rt file


def test_bit_flips_in_a_trace_file_are_detected(tmp_path):
    tr = synth_trace([3, 4, 5], 32, 4, 60, 2, seed=5)
    p = tmp_path / "t.rt"
    save_trace(tr, p)
    data = p.read_bytes()
    rng = np.random.default_rng(0)
    for off in list(range(8, 32)) + rng.integers(32, len(data), 40).tolist():
        bad = bytearray(data)
        bad[off] ^= 1 << int(rng.integers(0, 8))
        p.write_bytes(bytes(bad))
        with pytest.raises(InputError, match=str(p)):
            load_trace(p)
    p.write_bytes(bytes(bad))
    one_line_error(cli("trace", "stats", p), "t.rt")
    p.write_bytes(data[:20] + bytes([data[20] ^ 4]) + data[21:])
    with pytest.raises(InputError, match="checksum mismatch"):
        load_trace(p)


def test_trace_versions(tmp_path):
    tr = synth_trace([3, 4], 16, 2, 20, 1, seed=1)
    header, arrays = rt_parts(tr)
    # version 1 (no digest) stays readable
    header1 = dict(header, version=1)
    back = load_trace(write_rt(tmp_path / "v1.rt", header1, arrays, version=1, digest=False))
    assert back.experts.tolist() == tr.experts.tolist()
    with pytest.raises(InputError, match="version 3 is not supported.*re-import"):
        load_trace(write_rt(tmp_path / "v3.rt", dict(header, version=3), arrays, version=3))


def _edit(header, path, value):
    h = json.loads(json.dumps(header))
    obj = h
    for key in path[:-1]:
        obj = obj[key]
    if value is KeyError:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    return h


@pytest.mark.parametrize("path, value", [
    (("geometry",), KeyError), (("geometry",), "glm"), (("geometry", "layers"), KeyError),
    (("geometry", "layers"), [4, 3]), (("geometry", "layers"), [3, 70000]), (("geometry", "layers"), "34"),
    (("geometry", "n_experts"), 2**40), (("geometry", "n_experts"), True), (("geometry", "n_experts"), 4.0),
    (("geometry", "n_experts"), 2), (("geometry", "top_k"), 3), (("geometry", "top_k"), -1),
    (("sessions",), KeyError), (("sessions",), [1]), (("sessions",), "s"), (("heat_only",), "no"),
    (("heat_only",), True), (("meta",), []), (("arrays",), KeyError), (("arrays",), {}), (("arrays", 0), "x"),
    (("arrays", 0, "name"), "heat"), (("arrays", 0, "name"), "bogus"), (("arrays", 1, "name"), "row_forward"),
    (("arrays", 0, "dtype"), "<i8"), (("arrays", 0, "dtype"), "O"), (("arrays", 0, "shape"), [2**62]),
    (("arrays", 0, "shape"), [-1]), (("arrays", 3, "shape"), [40, 3]), (("arrays", 5, "shape"), [1]),
    (("arrays", 0, "shape"), "40"), (("version",), 1), (("version",), True),
])
def test_edited_trace_header_is_one_error(tmp_path, path, value):
    tr = synth_trace([3, 4], 16, 2, 20, 1, seed=1)
    header, arrays = rt_parts(tr)
    p = write_rt(tmp_path / "e.rt", _edit(header, path, value), arrays)
    with pytest.raises(InputError, match=str(p)):
        load_trace(p)


@pytest.mark.parametrize("name, index, value, match", [
    ("experts", (0, 0), 20, "n_experts"), ("experts", (0, 0), -5, "negative"), ("experts", (0, 1), -1, None),
    ("experts", (0, 0), -1, "no expert|padding"), ("experts", (0, 1), None, "twice"),
    ("gates", (0, 0), np.inf, "infinite"), ("row_position", (0,), -3, "position"),
    ("row_forward", (0,), 10**6, "forward"), ("fwd_kind", (0,), 9, "kind"), ("fwd_evaluated", (0,), 0, "evaluated"),
    ("fwd_committed", (0,), -1, "negative"), ("fwd_session", (0,), 5, "session"),
    ("row_layer", (0,), 9, "layer"),
])
def test_edited_trace_arrays_are_validated(tmp_path, name, index, value, match):
    tr = synth_trace([3, 4], 16, 2, 20, 1, seed=1)
    header, arrays = rt_parts(tr)
    arr = arrays[[a["name"] for a in header["arrays"]].index(name)]
    arr[index] = arr[0, 0] if value is None else value
    p = write_rt(tmp_path / "a.rt", header, arrays)
    if match is None:  # trailing padding is legal
        assert load_trace(p).experts[0].tolist()[1] == -1
        return
    with pytest.raises(InputError, match=match):
        load_trace(p)


# ------------------------------------------------------------------ 4: bounded trace stats


def big_expert_trace():
    """A valid trace with 32768 experts per layer, the format's limit (dense [E, E] = 8 GiB)."""
    E, k = 32768, 4
    rng = np.random.default_rng(0)
    F, layers = 200, [3, 4]
    ex = np.stack([rng.choice(E, size=k, replace=False) for _ in range(F * len(layers))]).astype(np.int16)
    tr = RoutingTrace(
        layers=np.array(layers, np.int16), n_experts=E, top_k=k, geometry="big", sessions=["s"],
        row_forward=np.repeat(np.arange(F, dtype=np.int32), 2), row_layer=np.tile(np.array(layers, np.int16), F),
        row_position=np.zeros(2 * F, np.int32), experts=ex, gates=np.full(ex.shape, np.nan, np.float32),
        fwd_session=np.zeros(F, np.int32), fwd_kind=np.zeros(F, np.int8), fwd_evaluated=np.ones(F, np.int32),
        fwd_committed=np.ones(F, np.int32),
    )
    tr.validate()
    return tr


def test_trace_stats_memory_does_not_grow_with_experts_squared():
    tr = big_expert_trace()
    tracemalloc.start()
    s = trace_stats(tr, min_count=1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20, peak
    assert s["layers"][0]["rows"] == 200 and s["layers"][0]["pairs_supported"] > 0


def test_coli_pairs_export_memory_does_not_grow_with_experts_squared(tmp_path):
    tr = big_expert_trace()
    tracemalloc.start()
    n = write_coli_pairs(tr, tmp_path / "p.coli_pairs")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20, peak
    assert 0 < n <= 4 * 200


def test_trace_stats_on_many_layers_is_linear():
    # one sort finds every layer's rows (not one pass over all rows per layer)
    tr = synth_trace(list(range(0, 3000)), 8, 2, 3, 1, seed=0)
    s = trace_stats(tr)
    assert len(s["layers"]) == 3000 and all(entry["rows"] == 3 for entry in s["layers"])


# ------------------------------------------------------------------ 8: property tests

TOKENS = [b"-1", b"0", b"65536", b"4294967295", b"9223372036854775808", b"1e308", b"1e999", b"nan", b"inf", b"_",
          b":", b".", b"::", b"true", b"false", b"null", b"[", b"]", b"{", b"}", b'"', b",", b"\n", b" ", b"\r",
          b"99999999999999999999", b"#", b"\x00", b"\xff", b"-2 ", b"-1 ", b"3 ", b"0:0.5", b'"step": true',
          b'"required": "false"', b'"expert_id": 40000', b'"layer": 1e308', b"\x28\xb5\x2f\xfd"]

NUMBERS = [b"65538", b"40000", b"4095", b"4096", b"4294967295", b"1e308", b"9223372036854775808", b"-1", b"1_0",
           b"true", b"false", b'"false"', b"inf", b"0.5:0.2", b"3.0", b"[[[[1]]]]", b"null", b"2147483648", b"0"]

mutation = st.one_of(
    st.tuples(st.just("number"), st.integers(0, 10**6), st.integers(0, len(NUMBERS) - 1)),
    st.tuples(st.just("dupline"), st.integers(0, 10**6), st.integers(0, 10**6)),
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.integers(0, len(TOKENS) - 1)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 16)),
    st.tuples(st.just("word"), st.integers(0, 10**6), st.sampled_from([0, 1, 2, 0xFFFF, 0x10000, 2**31, 2**32 - 1])),
)


def mutate(data: bytes, ops) -> bytes:
    import re

    b = bytearray(data)
    for kind, pos, arg in ops:
        if not b:
            break
        if kind == "number":  # replace one whole number with an awkward one
            runs = [m.span() for m in re.finditer(rb"[0-9][0-9.e+-]*", bytes(b))]
            if runs:
                lo, hi = runs[pos % len(runs)]
                b[lo:hi] = NUMBERS[arg]
            continue
        if kind == "dupline":  # repeat a line somewhere else
            lines = bytes(b).split(b"\n")
            lines.insert(arg % (len(lines) + 1), lines[pos % len(lines)])
            b = bytearray(b"\n".join(lines))
            continue
        pos %= len(b)
        if kind == "flip":
            b[pos] ^= 1 << arg
        elif kind == "truncate":
            del b[pos:]
        elif kind == "insert":
            b[pos:pos] = TOKENS[arg]
        elif kind == "delete":
            del b[pos:pos + arg]
        else:
            pos -= pos % 4
            b[pos:pos + 4] = struct.pack("<I", arg)
    return bytes(b)


def import_and_stats(path, **kw):
    """Import, and when that succeeds save, load and describe: only InputError may escape."""
    try:
        tr, _ = import_traces([path], **kw)
    except InputError:
        return None
    out = path.with_suffix(".out.rt")
    save_trace(tr, out)
    back = load_trace(out)
    trace_stats(back)
    return back


def seeds():
    route_prefill = "0 0 3 1:0.5 2:0.5\n0 1 3 3:0.25 1:0.75\n1 0 4 2:0.5 5:0.5\n1 1 4 6:0.5 7:0.5\n"
    return {
        "route": [ROUTE.encode(), route_prefill.encode()],
        "stall": [stall_text().encode()],
        "mblt": [mblt_bytes(MBLT_RECORDS)],
        "coli_usage": [b"-1 78 8\n-2 1 7\n3 1 10\n3 2 5\n4 7 1\n"],
    }


FUZZ = settings(max_examples=fuzz_examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize("fmt", ["route", "stall", "mblt", "coli_usage"])
def test_fuzzed_imports_succeed_or_raise_input_error(tmp_path, fmt):
    @FUZZ
    @given(st.integers(0, 1), st.lists(mutation, min_size=1, max_size=4), st.booleans(), st.booleans())
    def run(which, ops, forced, geometry):
        base = seeds()[fmt]
        data = mutate(base[which % len(base)], ops)
        p = tmp_path / f"f.{fmt}"
        p.write_bytes(data)
        kw = {"fmt": fmt} if forced else {}
        if geometry:
            kw.update(n_experts=256, geometry="glm-5.2-int4-row")
        import_and_stats(p, **kw)

    run()


def test_fuzzed_trace_files_load_or_raise_input_error(tmp_path):
    tr = synth_trace([3, 4], 16, 2, 12, 2, seed=3)
    p0 = tmp_path / "t.rt"
    save_trace(tr, p0)
    data = p0.read_bytes()
    header, arrays = rt_parts(tr)

    @FUZZ
    @given(st.lists(mutation, min_size=1, max_size=3), st.integers(0, 2), st.integers(0, 10**6), st.integers(-70000, 70000))
    def run(ops, mode, where, value):
        p = tmp_path / "m.rt"
        if mode == 0:  # raw damage: the digest must catch it
            p.write_bytes(mutate(data, ops))
        elif mode == 1:  # damaged header text, digest recomputed: the header checks must catch it
            raw = mutate(json.dumps(header).encode(), ops)
            fields = struct.pack("<II", 2, len(raw))
            payload = zstandard.ZstdCompressor().compress(raw + b"".join(a.tobytes() for a in arrays))
            p.write_bytes(MAGIC + fields + xxhash.xxh3_128(fields + payload).digest() + payload)
        else:  # damaged array values, digest recomputed: validate must catch it
            arrs = [a.copy() for a in arrays]
            a = arrs[where % len(arrs)]
            if a.size:
                flat = a.reshape(-1)
                flat[(where // 7) % flat.size] = np.array(value).astype(flat.dtype) if flat.dtype.kind != "f" else value / 7.0
            write_rt(p, header, arrs)
        try:
            back = load_trace(p)
        except InputError:
            return
        trace_stats(back)

    run()
