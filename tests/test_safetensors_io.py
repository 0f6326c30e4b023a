"""The safetensors reader refuses every malformed header cleanly; the writer places bytes exactly."""

import json
import struct

import pytest
from conftest import fuzz_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from containers.errors import InputError
from containers.safetensors_io import (
    DTYPE_SIZES,
    TensorSpec,
    plan_shard,
    read_header,
    write_shard,
)
from containers.sources import FileRange, SeededBytes


class InlineBytes:
    """A byte source of known bytes, for tests."""

    def __init__(self, data: bytes):
        self.data, self.nbytes = data, len(data)

    def chunks(self):
        yield self.data

    def describe(self):
        return "inline bytes"


def raw_file(path, header_obj, data=b"", pad_to=None):
    raw = json.dumps(header_obj).encode()
    if pad_to:
        raw += b" " * (-(8 + len(raw)) % pad_to)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def entry(dtype, shape, a, b):
    return {"dtype": dtype, "shape": shape, "data_offsets": [a, b]}


def test_valid_file_reads_back(tmp_path):
    p = raw_file(tmp_path / "a.safetensors", {"x": entry("F32", [2, 2], 0, 16), "__metadata__": {"k": "v"}}, bytes(16))
    h = read_header(p)
    t = h.tensors["x"]
    assert (t.dtype, t.shape, t.nbytes, t.begin) == ("F32", (2, 2), 16, h.data_start)
    assert h.metadata == {"k": "v"}


@pytest.mark.parametrize(
    "header, data, words",
    [
        ({"x": entry("F32", [4], 0, 16)}, bytes(8), "truncated"),
        ({"x": entry("F32", [4], 8, 4)}, bytes(16), "out of order"),
        ({"x": entry("F32", [4], 0, 16), "y": entry("F32", [4], 8, 24)}, bytes(24), "overlap"),
        ({"x": entry("Q4", [4], 0, 4)}, bytes(4), "unknown dtype"),
        ({"x": entry("F32", [3], 0, 16)}, bytes(16), "needs 12 bytes"),
        ({"x": entry("U8", [2**40, 2**40], 0, 4)}, bytes(4), "overflows"),
        ({"x": entry("F32", [-1], 0, 4)}, bytes(4), "non-negative"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}}, bytes(4), "exactly"),
        ({"x": entry("F32", [1], 0, 4), "__metadata__": {"k": 1}}, bytes(4), "strings"),
        ([1, 2], b"", "not a JSON object"),
        ({"x": entry("F32", [True], 0, 4)}, bytes(4), "non-negative"),
    ],
)
def test_malformed_headers_are_refused_with_the_file_named(tmp_path, header, data, words):
    p = raw_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(InputError) as exc:
        read_header(p)
    assert str(p) in str(exc.value) and words in str(exc.value)
    assert "\n" not in str(exc.value)


def test_duplicate_json_key_is_refused(tmp_path):
    raw = b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"x":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
    p = tmp_path / "dup.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"ab")
    with pytest.raises(InputError, match="duplicate key"):
        read_header(p)


def test_header_length_bounds(tmp_path):
    p = tmp_path / "huge.safetensors"
    p.write_bytes(struct.pack("<Q", 600 * 2**20) + b"{}")
    with pytest.raises(InputError, match="512 MiB"):
        read_header(p)
    p.write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(InputError, match="past the end"):
        read_header(p)
    p.write_bytes(b"abc")
    with pytest.raises(InputError, match="too short"):
        read_header(p)


@settings(max_examples=fuzz_examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=300))
def test_random_bytes_never_crash(tmp_path, blob):
    p = tmp_path / "fuzz.safetensors"
    p.write_bytes(blob)
    try:
        read_header(p)
    except InputError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=fuzz_examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pos=st.integers(0, 10_000), value=st.integers(0, 255), cut=st.integers(0, 10_000), mode=st.sampled_from(["flip", "cut"]))
def test_mutated_valid_header_is_a_clean_error_or_still_valid(tmp_path, pos, value, cut, mode):
    specs = [TensorSpec(f"t{i}", "F32", (i + 1, 3), SeededBytes(1, f"t{i}", 12 * (i + 1))) for i in range(5)]
    p = tmp_path / "m.safetensors"
    write_shard(p, specs, alignment=64, metadata={"a": "b"})
    data = bytearray(p.read_bytes())
    if mode == "flip":
        data[pos % len(data)] = value
    else:
        del data[cut % len(data):]
    p.write_bytes(bytes(data))
    try:
        h = read_header(p)
    except InputError as exc:
        assert str(p) in str(exc) and "\n" not in str(exc)
    else:
        for t in h.tensors.values():
            assert t.end <= h.file_size


tensor_sets = st.lists(
    st.tuples(st.sampled_from(sorted(DTYPE_SIZES)), st.lists(st.integers(0, 9), min_size=0, max_size=3)),
    min_size=1,
    max_size=8,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=tensor_sets, alignment=st.sampled_from([1, 8, 64, 4096]), order=st.randoms(use_true_random=False))
def test_writer_round_trip_places_bytes_in_the_chosen_order(tmp_path, tensors, alignment, order):
    specs = []
    for i, (dtype, shape) in enumerate(tensors):
        n = DTYPE_SIZES[dtype]
        for d in shape:
            n *= d
        specs.append(TensorSpec(f"z{i:02d}" if i % 2 else f"a{i:02d}", dtype, tuple(shape), SeededBytes(3, str(i), n)))
    order.shuffle(specs)
    p = tmp_path / "w.safetensors"
    write_shard(p, specs, alignment=alignment, metadata={"tool": "test"})
    h = read_header(p)
    assert h.data_start % max(alignment, 8) == 0
    assert h.metadata == {"tool": "test"}
    # physical order is the order given, each tensor aligned, bytes intact
    physical = [t.name for t in h.by_offset() if t.nbytes] 
    assert physical == [s.name for s in specs if s.nbytes]
    blob = p.read_bytes()
    for s in specs:
        t = h.tensors[s.name]
        assert (t.begin - h.data_start) % alignment == 0
        assert blob[t.begin:t.end] == b"".join(bytes(c) for c in s.source.chunks())
    # header keys are sorted by name, whatever the data order
    n = struct.unpack("<Q", blob[:8])[0]
    keys = [k for k in json.loads(blob[8:8 + n]) if k != "__metadata__"]
    assert keys == sorted(keys)


def test_per_tensor_alignment_override_packs_tensors_adjacent(tmp_path):
    specs = [
        TensorSpec("a", "U8", (100,), InlineBytes(b"a" * 100)),
        TensorSpec("b", "U8", (100,), InlineBytes(b"b" * 100), alignment=1),
        TensorSpec("c", "U8", (100,), InlineBytes(b"c" * 100)),
    ]
    p = tmp_path / "o.safetensors"
    write_shard(p, specs, alignment=4096)
    h = read_header(p)
    assert h.tensors["b"].begin == h.tensors["a"].end
    assert (h.tensors["c"].begin - h.data_start) % 4096 == 0


def test_writer_copies_file_ranges_and_refuses_short_sources(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 40)
    p = tmp_path / "r.safetensors"
    write_shard(p, [TensorSpec("x", "U8", (1000,), FileRange(src, 5000, 1000))])
    h = read_header(p)
    assert p.read_bytes()[h.tensors["x"].begin:h.tensors["x"].end] == src.read_bytes()[5000:6000]
    bad = tmp_path / "bad.safetensors"
    with pytest.raises(InputError, match="truncated"):
        write_shard(bad, [TensorSpec("x", "U8", (1000,), FileRange(src, 9900, 1000))])
    assert not bad.exists(), "a failed write must not leave a file under the final name"
    assert not list(tmp_path.glob(".bad*")), "nor a temp file"


def test_plan_refuses_shape_size_mismatch():
    with pytest.raises(InputError, match="does not match"):
        plan_shard([TensorSpec("x", "F32", (3,), InlineBytes(bytes(8)))])
