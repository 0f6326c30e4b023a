"""Bad input is bounded and refused in one line: numeric options, STALL_TRACE fields, gate
evidence, device profiles, decompression bombs, duplicate JSON keys, schedulers that never
answer, and signals."""

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO, fuzz_examples, run_cli
from containers import records
from containers.errors import InputError
from containers.jsonfile import MAX_LINE_BYTES, iter_jsonl, parse_json, read_bytes
from relayout import cli
from relayout.cli.parser import build_parser
from replay.evaluation.evidence import Evidence, block_evidence, session_evidence
from replay.formats.gatefile import GateEvidence
from replay.physical.stalltrace import read_stall_trace

BAD_NUMBERS = ["nan", "inf", "-inf", "1e30", "-1", "1e400", "x", "0x10", ""]

REPLAY = ["replay", "--layout", "p.json", "--trace", "t.rt", "--device", "single-nvme"]
PLAN = ["plan", "--trace", "t.rt", "-o", "p.json", "--geometry", "glm-5.2-int4-g64"]
PLACEMENT = ["placement", "--layout", "p.json", "--trace", "t.rt", "--device", "single-nvme"]
SPLIT_CURVE = ["split-curve", "--layout", "p.json", "--trace", "t.rt", "--device", "single-nvme"]
MEASURE = ["measure", "--container", "c", "--trace", "t.rt"]
SYNTH = ["synth", "container", "out", "--geometry", "glm-5.2-int4-g64"]
OPTIONS = [
    *[(REPLAY, o) for o in ("--ram-gb", "--pin-gb", "--coalesce-max-mb", "--prefetch-budget-mb", "--sweep-ram",
                            "--dense-ms", "--compute-gbps", "--threshold", "--other-ms", "--min-sessions",
                            "--prefetch-experts", "--workers", "--sweep-workers", "--sweep-budgets-mb", "--source-caps")],
    *[(PLAN, o) for o in ("--shard-mb", "--split-ram-gb", "--cache-gb", "--alignment", "--train-fraction", "--split-ratio",
                          "--resolution", "--seed", "--source-shard-mb", "--experts", "--moe-layers")],
    *[(PLACEMENT, o) for o in ("--ram-gb", "--pin-gb", "--dense-ms", "--compute-gbps", "--pin-share", "--half-life")],
    *[(SPLIT_CURVE, o) for o in ("--ram-gb", "--ratios", "--top-shares", "--coalesce-max-mb")],
    *[(MEASURE, o) for o in ("--dense-ms", "--compute-gbps", "--coalesce-max-mb", "--tokens")],
    *[(SYNTH, o) for o in ("--shard-mb", "--seed", "--hidden")],
    (["validate", "d"], "--gb"), (["validate", "d"], "--minutes"), (["calibrate", "d", "-o", "x.json"], "--seconds"),
    (["synth", "trace", "t.rt", "--geometry", "glm-5.2-int4-g64"], "--tokens"), (["demo"], "--seed"),
]


def _main(argv, capsys) -> tuple[int, str]:
    try:
        status = cli.main(argv)
    except SystemExit as exc:
        status = exc.code
    return status, capsys.readouterr().err


@settings(max_examples=fuzz_examples(80), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(OPTIONS), st.sampled_from(BAD_NUMBERS))
def test_fuzz_numeric_options_refuse_non_finite_huge_and_negative_values(capsys, case, value):
    command, option = case
    if value == "-1" and option in ("--source-caps",):
        value = "2"
    status, err = _main([*command, f"{option}={value}"], capsys)
    assert status == 2, (command, option, value, err)
    assert err.count("\n") == 1 and err.startswith("relayout: error: argument ") and option in err, err
    assert "Traceback" not in err


def test_alignment_zero_and_negative_and_threshold_nan_are_refused_by_the_parser(capsys):
    for argv in ([*PLAN, "--alignment", "0"], [*PLAN, "--alignment", "-1"], [*REPLAY, "--threshold", "nan"],
                 [*REPLAY, "--sweep-ram", "0,64,nan"], [*REPLAY, "--sweep-workers", "1,2.5"]):
        status, err = _main(argv, capsys)
        assert status == 2 and err.count("\n") == 1 and "argument --" in err, (argv, err)


def test_options_parse_their_defaults_and_good_values():
    args = build_parser().parse_args([*REPLAY, "--ram-gb", "12.5", "--sweep-ram", "0,64", "--source-caps", "0.5,0.5"])
    assert args.ram_gb == 12.5 and args.sweep_ram == (0.0, 64.0) and args.sweep_workers == (1, 2, 8, 16)
    assert args.source_caps == (0.5, 0.5) and args.threshold == 0.05 and args.coalesce_max_mb == pytest.approx(268.435456)
    args = build_parser().parse_args([*PLAN, "--alignment", "65536"])
    assert args.alignment == 65536 and args.shard_mb == 4000


def test_a_bad_option_in_a_real_process_is_one_line_exit_2():
    res = run_cli(*REPLAY, "--ram-gb", "nan")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--ram-gb" in res.stderr and "Traceback" not in res.stderr


# ------------------------------------------------------------------ STALL_TRACE fields


def _expert(**kw):
    rec = {"run_id": "r", "request_id": 0, "step": 0, "layer": 3, "expert_id": 1, "required": True, "bytes": 1000,
           "issue_ns": 0, "ready_ns": 500, "need_ns": 200}
    rec.update(kw)
    return rec


def _step(**kw):
    rec = {"record": "step", "run_id": "r", "request_id": 0, "step": 0, "committed_tokens": 1, "evaluated_positions": 1,
           "compute_ns": 1000, "other_ns": 10, "wall_ns": 5000}
    rec.update(kw)
    return rec


EXPERT_FIELDS = ["step", "layer", "expert_id", "bytes", "issue_ns", "ready_ns", "need_ns", "segment_id", "required",
                 "used_before_eviction", "foreground_stall_ns", "queue_depth", "worker_occupancy"]
STEP_FIELDS = ["committed_tokens", "evaluated_positions", "compute_ns", "other_ns", "wall_ns", "stall_ns"]
BAD_VALUES = [2**63, 2**64, -1, 1e30, 1.5, "false", "1", None, [], {}, True]


@settings(max_examples=fuzz_examples(120), deadline=None)
@given(st.booleans(), st.data())
def test_fuzz_stall_trace_fields_are_refused_naming_file_line_and_field(tmp_path_factory, in_step, data):
    field = data.draw(st.sampled_from(STEP_FIELDS if in_step else EXPERT_FIELDS))
    value = data.draw(st.sampled_from(BAD_VALUES))
    if value is True and field in ("required", "used_before_eviction"):
        value = "true"
    if value is None and field in ("foreground_stall_ns", "queue_depth", "worker_occupancy", "compute_ns", "other_ns",
                                   "wall_ns", "stall_ns"):
        value = -5                      # null means "not recorded" for these
    bad = _step(**{field: value}) if in_step else _expert(**{field: value})
    path = tmp_path_factory.mktemp("st") / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (_step(step=1), _expert(step=1), bad)) + "\n")
    with pytest.raises(InputError) as e:
        read_stall_trace(path)
    assert e.value.where == f"{path}:3" and "\n" not in str(e.value)
    assert field in str(e.value) or field.replace("_ns", "") in str(e.value) or "ready_ns" in str(e.value), str(e.value)


def test_absurd_but_integer_stall_trace_values_are_refused(tmp_path):
    for bad in (_expert(layer=10**30), _expert(step=10**30), _expert(ready_ns=2**63 - 1), _expert(segment_id=-1),
                _step(compute_ns=10**30), _expert(ready_ns=10**17, need_ns=0, issue_ns=0)):
        path = tmp_path / "t.jsonl"
        path.write_text(json.dumps(_step()) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(InputError, match=":2"):
            read_stall_trace(path)


def test_a_good_stall_trace_still_reads(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (_step(), _expert(segment_id=1, used_before_eviction=False))) + "\n")
    runs = read_stall_trace(path)
    assert runs["r"].segment == [1] and runs["r"].used == [False]


# ------------------------------------------------------------------ decompression, long lines, duplicate keys


def _newline_bomb(path, mib=256):
    with open(path, "wb") as fh, zstandard.ZstdCompressor(level=3).stream_writer(fh) as w:
        block = b"\n" * (1 << 20)
        for _ in range(mib):
            w.write(block)
    return path


@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    return _newline_bomb(tmp_path_factory.mktemp("bomb") / "run.jsonl.zst")


def test_a_zstd_newline_bomb_is_refused_by_every_reader(bomb, capsys, tmp_path):
    assert bomb.stat().st_size < 64 * 1024
    with pytest.raises(InputError, match="decompression bomb"):
        list(iter_jsonl(bomb))
    with pytest.raises(InputError, match="decompression bomb"):
        read_bytes(bomb)
    for argv in (["report", str(bomb)], ["compare", str(bomb), str(bomb)],
                 ["trace", "import", str(bomb), "-o", str(tmp_path / "t.rt")]):
        status, err = _main(argv, capsys)
        assert status == 2 and err.count("\n") == 1 and "decompression bomb" in err, (argv, err)
    assert not (tmp_path / "t.rt").exists()


def test_a_compressed_trace_within_the_ratio_reads(tmp_path):
    recs = [_step(step=s) for s in range(50)] + [_expert(step=s, expert_id=s % 7) for s in range(50)]
    path = tmp_path / "t.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(("\n\n".join(json.dumps(r) for r in recs) + "\n").encode()))
    assert len(read_stall_trace(path)["r"].expert) == 50


def test_an_overlong_line_is_refused_naming_it(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(_step()).encode() + b"\n" + b" " * (MAX_LINE_BYTES + 10) + b"x")
    with pytest.raises(InputError, match="longer than") as e:
        list(iter_jsonl(path))
    assert e.value.where == f"{path}:2"


def test_duplicate_keys_are_invalid_json(tmp_path, small_container):
    with pytest.raises(ValueError, match="given twice"):
        parse_json('{"a": 1, "b": {"c": 1, "c": 2}}')
    path = tmp_path / "t.jsonl"
    path.write_text('{"record": "step", "step": 0, "step": 1}\n')
    with pytest.raises(InputError, match="given twice"):
        list(iter_jsonl(path))
    import shutil

    from containers.container import Container

    copy = tmp_path / "c"
    shutil.copytree(small_container, copy)
    text = (copy / "config.json").read_text()
    (copy / "config.json").write_text(text.replace("{", '{"n_routed_experts": 1, ', 1))
    with pytest.raises(InputError, match="given twice"):
        Container.open(copy)


# ------------------------------------------------------------------ gate evidence


def _stored_evidence(obj, where):
    """The evidence part of a gate record read as a gate record reads it: typed, then range-checked."""
    verdict = {"sufficient": True, "sufficiency": "", "min_sessions": 1, "p_below_threshold": 0.0}
    return Evidence.from_record(records.from_json(GateEvidence, {**obj, **verdict}, where, "gate record"), where)


def _evidence_json(method="session", n=8):
    rng = np.random.default_rng(1)
    base, new, tokens = rng.random(n), rng.random(n), rng.integers(1, 50, n)
    ev = session_evidence(base, new, tokens) if method == "session" else block_evidence(base, new, tokens, np.repeat([0, 1], n // 2))
    return ev.to_json()


@settings(max_examples=fuzz_examples(80), deadline=None)
@given(st.sampled_from(["session", "moving-block"]), st.sampled_from(["seed", "resamples", "block_steps", "n_sessions",
                                                                      "session", "committed_tokens", "baseline_stall_s"]),
       st.sampled_from([-1, 2**63, 10**6, 10**30, 1.5, "3", None, float("nan"), 1e300]))
def test_fuzz_gate_evidence_is_range_checked_before_allocation(method, field, value):
    obj = _evidence_json(method, 20000 if value == 10**6 else 40)
    if field in ("session", "committed_tokens", "baseline_stall_s"):
        if field == "session" and method == "session":
            return
        obj["units"][field] = list(obj["units"][field])
        obj["units"][field][-1] = value
    else:
        obj[field] = value
    try:
        ev = _stored_evidence(obj, "gate.json")
    except InputError as e:
        assert e.where == "gate.json" and "\n" not in str(e)
        return
    ev.interval()       # whatever is accepted recomputes without error


def test_a_huge_resample_request_is_refused_without_allocating():
    obj = _evidence_json("session", 20000)
    obj["resamples"] = 10**6
    with pytest.raises(InputError, match="draw"):
        _stored_evidence(obj, "gate.json")
    obj = _evidence_json("moving-block", 40)
    obj["block_steps"] = 41
    with pytest.raises(InputError, match="block_steps"):
        _stored_evidence(obj, "gate.json")
    assert _stored_evidence(_evidence_json("moving-block", 40), "g").interval()


# ------------------------------------------------------------------ device profiles


@pytest.mark.parametrize("field, value", [
    ("direct_alignment", 2**40), ("direct_alignment", 0), ("members", 10**6), ("chunk_bytes", 1),
    ("host_bandwidth", 1e300), ("drive.queue_slots", 10**12), ("drive.queue_slots", 0), ("drive.bandwidth", -1.0),
    ("drive.request_seconds", 1e9), ("drive.request_channel_seconds", 1e9), ("drive.stream_bandwidth", 1e300),
    ("drive.max_request_bytes", 2**60), ("members", 1.5), ("direct_alignment", "4096"),
])
def test_absurd_device_profile_fields_are_one_line_errors_naming_the_file(tmp_path, field, value):
    from replay.model.device import load_device

    obj = json.loads((REPO / "manifests" / "devices" / "linux-md-raid0-4x.json").read_text())
    target, _, name = field.rpartition(".")
    (obj[target] if target else obj)[name] = value
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(InputError) as e:
        load_device(str(path))
    assert e.value.where == str(path) and name in str(e.value)


def test_shipped_device_profiles_load():
    from containers.jsonfile import shipped_names
    from replay.model.device import load_device

    for name in shipped_names("devices"):
        load_device(name)


# ------------------------------------------------------------------ schedulers that never answer


def _listener(greeting: bytes = b""):
    """A loopback listener that accepts, sends ``greeting`` and then nothing."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held = []

    def accept():
        while True:
            try:
                conn = srv.accept()[0]
                conn.sendall(greeting)
                held.append(conn)
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return srv, held


class _QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.mark.parametrize("kind", ["silent", "http", "garbage"])
def test_a_scheduler_address_that_never_answers_as_dask_is_an_error_within_seconds(kind):
    pytest.importorskip("distributed")
    from replay.execution import open_executor

    if kind != "http":
        srv, held = _listener(b"HTTP/1.1 200 OK\r\n\r\n" if kind == "garbage" else b"")
        port, close = srv.getsockname()[1], srv.close
    else:
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        port, close = httpd.server_address[1], httpd.shutdown
    try:
        t0 = time.monotonic()
        with pytest.raises(InputError, match="not a Dask scheduler" if kind == "garbage" else "did not answer within 0.5 s"):
            with open_executor(f"tcp://127.0.0.1:{port}", timeout_s=0.5):
                pass
        assert time.monotonic() - t0 < 30
    finally:
        close()


# ------------------------------------------------------------------ signals


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_command_with_one_line_and_status_130(tmp_path, sig):
    fifo = tmp_path / "run.jsonl"
    os.mkfifo(fifo)                       # report blocks opening it until the signal comes
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "relayout", "report", str(fifo)], stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(1.0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.count("\n") == 1 and "interrupted" in err and "Traceback" not in err
