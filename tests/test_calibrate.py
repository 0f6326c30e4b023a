"""Calibration's read buffers (as colibrì's, or the harness's huge pages), the request limit each
gives the fit, and the page-cache copy rate a profile carries as ``memory_bandwidth``."""

import json
import math
import mmap
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from containers.errors import InputError
from replay.model.device import DEFAULT_MEMORY_BANDWIDTH, ArrayProfile, load_device
from replay.physical import calibrate as cal
from replay.physical import copy_rate, request_limits
from replay.physical.buffers import HUGE_PAGE, read_buffer
from replay.physical.loader_handoff import POOL_SIZES
from relayout.render.measurements import format_calibration

MIB = 1 << 20
SMALL = {"max_segments": 254, "page_bytes": 4096, "bytes": 254 * 4096, "transparent_hugepage": "madvise"}


def _anon_huge_kb(buf: memoryview) -> int | None:
    """AnonHugePages (KiB) of the mapping holding ``buf`` (/proc/self/smaps), None where unknown."""
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


def _thp_mode() -> str | None:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def test_an_engine_buffer_is_page_aligned_touched_and_asks_for_no_huge_pages():
    buf = read_buffer(3 * MIB + 5, huge_pages=False)
    import ctypes

    assert len(buf) == 3 * MIB + 4096 and not buf.readonly
    assert ctypes.addressof(ctypes.c_char.from_buffer(buf)) % mmap.PAGESIZE == 0
    assert bytes(buf[:16]) == bytes(16)
    huge = read_buffer(3 * MIB + 5)                          # the harness's: on a huge-page boundary
    assert ctypes.addressof(ctypes.c_char.from_buffer(huge)) % HUGE_PAGE == 0
    if sys.platform.startswith("linux") and _thp_mode() in ("madvise", "never"):
        # nothing asked for: no huge page backs it where the system gives them only when asked
        assert _anon_huge_kb(read_buffer(8 * MIB, huge_pages=False)) in (0, None)


@pytest.mark.parametrize("system, small, huge, direct, expect", [
    (4 * MIB, SMALL, True, True, 4 * MIB),                                  # huge pages: the system's limit
    (4 * MIB, SMALL, False, True, 254 * 4096),                              # base pages bind below it
    (512 * 1024, SMALL, False, True, 512 * 1024),                           # the system's is smaller
    (4 * MIB, {**SMALL, "transparent_hugepage": "always"}, False, True, 4 * MIB),   # engine buffers are huge too
    (4 * MIB, SMALL, False, False, 4 * MIB),                                # buffered: the buffer makes no request
    (4 * MIB, None, False, True, 4 * MIB),                                  # max_segments unknown
    (None, SMALL, False, True, 254 * 4096),                                 # only the pages' limit known
    (None, None, False, True, None),
])
def test_the_request_limit_follows_the_buffers(system, small, huge, direct, expect):
    limit, reason = request_limits.buffer_request_limit(system, small, huge, direct)
    assert limit == expect and reason
    if expect == 254 * 4096 and system:
        assert "254 segments" in reason and "transparent_hugepage=madvise" in reason


def test_the_page_cache_copy_rate_is_measured_on_a_real_file_and_leaves_it_as_it_was(tmp_path):
    f = tmp_path / "data.bin"
    data = np.random.default_rng(1).integers(0, 256, 9 * MIB, dtype=np.uint8).tobytes()
    f.write_bytes(data)
    before = f.stat()
    c = copy_rate.page_cache_copy(f, 0.05, huge_pages=False, threads=(1, 2))
    assert c["read_bytes"] == 2 * MIB and c["region_bytes"] == 8 * MIB    # whole reads within the file
    assert [r["threads"] for r in c["rates"]] == [1, 2]
    assert all(r["bytes_per_second"] > 0 and math.isclose(r["per_thread_Bps"], r["bytes_per_second"] / r["threads"])
               for r in c["rates"])
    assert c["bytes_per_second"] == c["rates"][0]["bytes_per_second"]
    assert c["resident_fraction"] in (None, 1.0) and c["cores"] >= 1
    assert c["unaligned_shift"] == copy_rate.UNALIGNED_SHIFT and len(c["unaligned_ratios"]) == copy_rate.PAIRED_TRIALS
    assert c["unaligned_bytes_per_second"] == pytest.approx(
        c["bytes_per_second"] * copy_rate.unaligned_factor(c["unaligned_ratios"]), rel=1e-12)
    assert f.read_bytes() == data and f.stat().st_mtime_ns == before.st_mtime_ns
    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(b"x" * 4096)
    with pytest.raises(InputError, match="tiny.bin.*too small for two"):
        copy_rate.page_cache_copy(tiny, 0.05)


@pytest.fixture
def profiles(calibrations):
    """The session's calibrations, one per buffer kind (conftest's ``calibrations``)."""
    return calibrations


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["engine", "huge-pages"])
def test_the_profile_records_the_buffers_read_into_and_the_request_limit_they_give(profiles, kind):
    profile, asked, d = profiles[kind]
    huge = kind == "huge-pages"
    assert asked and set(asked) == {huge}                  # every read landed in the kind asked for
    c = profile["calibration"]
    assert c["buffers"]["kind"] == kind and f"read buffers: {kind}" in profile["description"]
    direct = c["cache_control"].startswith("O_DIRECT")
    system = request_limits.system_max_request_bytes(d)
    small = request_limits.small_page_request_limit(d)
    expect, reason = request_limits.buffer_request_limit(system, small, huge, direct)
    assert c["request_limit"] == {"bytes": expect, "system_bytes": system, "reason": reason}
    # the limit the fit used is the drive's
    assert profile["drive"]["max_request_bytes"] == c["fit"]["max_request_bytes"] == expect
    if huge:
        assert expect == system
    elif direct and small and small["transparent_hugepage"] != "always" and system and small["bytes"] < system:
        assert expect == small["bytes"]                    # this project's virtio disk: 1016 KiB, not 4 MiB
    merge = c["merge"]                                     # merged: one request of the limit used
    assert merge["size"] == min(expect or cal.MERGE_BYTES, cal.MERGE_BYTES) // 2 // 4096 * 4096


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["engine", "huge-pages"])
def test_the_page_cache_copy_rate_is_the_profiles_memory_bandwidth_and_loads(profiles, kind, tmp_path):
    profile, _, _ = profiles[kind]
    copy = profile["calibration"]["page_cache_copy"]
    assert [r["threads"] for r in copy["rates"]] == list(copy_rate.COPY_THREADS)
    assert profile["memory_bandwidth"] == copy["rates"][0]["bytes_per_second"] > 0
    assert copy["region_bytes"] == 64 * MIB                  # the whole 64 MiB test file, in the page cache
    p = tmp_path / "device.json"
    p.write_text(json.dumps(profile))
    dev = load_device(str(p))
    assert dev.memory_bandwidth == profile["memory_bandwidth"]
    assert dev.unaligned_memory_bandwidth == profile["unaligned_memory_bandwidth"] == copy["unaligned_bytes_per_second"] > 0
    back = tmp_path / "again.json"
    back.write_text(json.dumps(dev.to_json()))
    assert load_device(str(back)) == dev and load_device(str(back)).digest() == dev.digest()
    handoff = profile["calibration"]["loader_handoff"]               # the host's loader pool, measured too
    if sys.platform.startswith("linux"):
        assert handoff["workers"] == list(POOL_SIZES) and len(handoff["seconds"]) == len(POOL_SIZES)
        assert dev.loader_handoff.workers == POOL_SIZES and list(dev.loader_handoff.seconds) == handoff["seconds"]
        assert "loader pool" in format_calibration(profile)
    else:
        assert dev.loader_handoff is None and handoff["error"]


@pytest.mark.slow
def test_the_small_page_warning_appears_only_for_a_huge_page_calibration(profiles):
    from relayout.render.measurements import format_calibration, small_page_warning

    engine, _, _ = profiles["engine"]
    huge, _, _ = profiles["huge-pages"]
    assert small_page_warning(engine) is None
    text = format_calibration(engine)
    assert "read buffers: engine" in text and "page-cache hits" in text and "memory_bandwidth" in text
    small = {"max_segments": 254, "page_bytes": 4096, "bytes": 254 * 4096, "transparent_hugepage": "madvise"}
    forced = {"drive": {**huge["drive"], "max_request_bytes": 4 * MIB},
              "calibration": {**huge["calibration"], "small_page_request_limit": small}}
    assert "a request here is at most 1016 KiB" in small_page_warning(forced)
    as_engine = {**forced, "calibration": {**forced["calibration"], "buffers": {"kind": "engine", "what": "x"}}}
    assert small_page_warning(as_engine) is None
    older = {**forced, "calibration": {k: v for k, v in forced["calibration"].items() if k != "buffers"}}
    assert small_page_warning(older) is not None         # a profile that does not say read into huge pages


def test_the_copy_sentence_gives_each_thread_counts_rate():
    from relayout.render.measurements import copy_sentence

    rates = [{"threads": n, "bytes_per_second": r, "per_thread_Bps": r / n} for n, r in ((1, 5e9), (2, 6e9), (4, 6.2e9))]
    c = {"read_bytes": 2 * MIB, "region_bytes": 256 * MIB, "seconds": 0.4, "rates": rates, "bytes_per_second": 5e9,
         "cores": 2, "resident_fraction": 1.0}
    text = copy_sentence({"calibration": {"page_cache_copy": c}})
    assert "5.00 GB/s on 1 thread" in text and "2 threads 6.00 GB/s (x1.20)" in text and "4 threads 6.20 GB/s (x1.24)" in text
    assert "on 2 cores" in text and "waited" not in text and "cache line" not in text
    text = copy_sentence({"calibration": {"page_cache_copy": {**c, "unaligned_shift": 8, "unaligned_bytes_per_second": 4e9}}})
    assert "reads starting 8 B into a cache line 4.00 GB/s on 1 thread (x0.80: unaligned_memory_bandwidth)" in text
    text = copy_sentence({"calibration": {"page_cache_copy": {**c, "unaligned_shift": 8, "unaligned_bytes_per_second": 5e9,
                                                              "unaligned_ratios": [0.97, 1.04, 1.08]}}})
    assert "(x1.00: unaligned_memory_bandwidth), 3 paired trials x0.97-x1.08: no difference told apart" in text
    text = copy_sentence({"calibration": {"page_cache_copy": {**c, "resident_fraction": 0.5}}})
    assert "only 50% of the region" in text
    assert copy_sentence({"calibration": {}}) is None


def test_a_profile_without_memory_bandwidth_loads_with_the_default_and_keeps_its_digest(tmp_path):
    old = load_device("single-nvme")
    assert old.memory_bandwidth == DEFAULT_MEMORY_BANDWIDTH == 10e9 and "memory_bandwidth" not in old.to_json()
    from dataclasses import replace

    measured = replace(old, memory_bandwidth=4.9e9)
    assert measured.digest() != old.digest() and measured.to_json()["memory_bandwidth"] == 4.9e9
    p = tmp_path / "mb.json"
    p.write_text(json.dumps(measured.to_json()))
    assert load_device(str(p)) == measured


@pytest.mark.parametrize("bad", [0, 0.0, -1e9, float("nan"), float("inf"), 1e17, True, "10e9", None])
def test_a_profile_with_a_bad_memory_bandwidth_is_refused_in_one_line(tmp_path, bad):
    obj = load_device("single-nvme").to_json()
    obj["memory_bandwidth"] = bad
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(obj))
    with pytest.raises(InputError, match="memory_bandwidth") as exc:
        load_device(str(p))
    assert "\n" not in str(exc.value) and "bad.json" in str(exc.value)
    with pytest.raises(InputError, match="memory_bandwidth"):
        ArrayProfile(**{**{k: getattr(load_device("single-nvme"), k) for k in ArrayProfile.__dataclass_fields__},
                        "memory_bandwidth": bad})


def test_calibrate_refuses_an_unknown_buffer_kind(capsys, tmp_path):
    from relayout import cli

    with pytest.raises(InputError, match="--buffers"):
        cal.calibrate(tmp_path, buffers="small")
    try:
        status = cli.main(["calibrate", str(tmp_path), "-o", str(tmp_path / "d.json"), "--buffers", "small"])
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "--buffers" in err
    assert not (tmp_path / "d.json").exists()


def test_an_unaligned_difference_is_given_only_when_every_paired_trial_says_it():
    """Pairs of one thread's unaligned and aligned copies, back to back: their median ratio when
    all lie on one side of 1, else none (noise between the trials, not a difference)."""
    assert copy_rate.unaligned_factor([0.80, 0.82, 0.79, 0.85, 0.81]) == pytest.approx(0.81)
    assert copy_rate.unaligned_factor([1.10, 1.20]) == pytest.approx(1.15)
    assert copy_rate.unaligned_factor([0.97, 1.02, 1.06, 1.05, 1.04]) == 1.0
    assert copy_rate.unaligned_factor([1.0, 1.1]) == 1.0 and copy_rate.unaligned_factor([]) == 1.0
