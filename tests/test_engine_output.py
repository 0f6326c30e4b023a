"""Reading colibrì runs' own measurements: recorded outputs of real runs (tests/data/engine/, the
storage-bound fixture of docs/ENGINE.md) drive the reader, report and compare."""

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import REPO, cli, fuzz_examples
from hypothesis import given, settings
from hypothesis import strategies as st

from containers.errors import InputError
from replay.colibri.engine_metrics import engine_compare, engine_report
from replay.colibri.engine_output import (
    RUN_FILE,
    EngineOutput,
    EngineRun,
    Profile,
    RunIdentity,
    looks_like_engine_output,
    parse_engine_output,
    read_run,
    read_runs,
)

DATA = REPO / "tests" / "data" / "engine"
STOCK = DATA / "stock-louvain" / "baseline"
LOUVAIN = DATA / "stock-louvain" / "container"
SAMPLED = DATA / "sampled" / "container"
MERGED = DATA / "merged-no-prof.log"


def _cli(*args):
    return cli(*args, cwd=REPO)


def _profile_numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"(\d+\.\d+)s", line)]


def test_a_recorded_run_reads_as_the_engine_printed_it():
    run_dir = sorted(p for p in STOCK.iterdir() if p.is_dir())[0]
    run = read_run(run_dir)
    stdout = (run_dir / "stdout.txt").read_bytes().decode("utf-8", "replace").splitlines()
    profiles = [line for line in stdout if line.startswith("PROFILE: expert-disk")]
    assert len(profiles) == 2, "text mode prints a prefill and a decode PROFILE line"
    decode = _profile_numbers(profiles[-1])
    prefill = _profile_numbers(profiles[0])
    o = run.output
    assert [o.decode.service_s, o.decode.wait_s, o.decode.matmul_s, o.decode.attention_s, o.decode.kvb_s,
            o.decode.lm_head_s, o.decode.other_s] == decode
    assert o.prefill.wait_s == prefill[1] and o.prefill.matmul_s == prefill[2]
    assert o.wait_s == decode[1]
    stderr = (run_dir / "stderr.txt").read_text(errors="replace")
    ids = re.search(r"\[TOKENS\] (\d+) generated:(.*)", stderr)
    assert o.output_tokens == [int(x) for x in ids[2].split()] and len(o.output_tokens) == int(ids[1])
    assert o.committed_tokens == int(re.search(r"decode (\d+) tokens in", "\n".join(stdout))[1])
    assert o.config["PIPE"] == "0" and o.config["DIRECT"] == "0" and o.cap == 4
    assert o.forwards is not None and o.forwards.forwards >= 1
    io = o.expert_io
    assert io is not None and io.loads > 0 and 0 <= io.hit_percent <= 100
    assert run.identity.arm == "baseline" and run.identity.env["CAP"] == "4" and run.identity.returncode == 0
    assert run.route_trace is not None and Path(run.route_trace).stat().st_size > 0


def test_merged_stdout_and_stderr_without_prof_still_give_s_and_tokens():
    """Captured with ``> log 2>&1``: the token lines follow generated text on the same line."""
    text = MERGED.read_bytes().decode("utf-8", "replace")
    assert re.search(r"[^\n]\[PROMPT_TOKENS\]", text), "the recorded file interleaves mid-line"
    run = read_run(MERGED)
    assert run.identity is None and run.output.config == {} and run.output.expert_io is None
    assert run.output.output_tokens is not None and len(run.output.output_tokens) == run.output.decode_tokens
    assert run.output.prompt_tokens[:5] == list("Short prompt".encode())[:5]
    assert run.output.wait_s == _profile_numbers([ln for ln in text.splitlines() if "PROFILE:" in ln][-1])[1]


def test_records_round_trip_and_reject_unknown_or_missing_fields():
    run = read_run(sorted(p for p in LOUVAIN.iterdir() if p.is_dir())[0])
    d = json.loads(json.dumps(run.to_json()))
    assert EngineRun.from_json(d) == run
    bad = json.loads(json.dumps(d))
    bad["output"]["decode"]["extra"] = 1
    with pytest.raises(InputError, match="unknown"):
        EngineRun.from_json(bad)
    bad = json.loads(json.dumps(d))
    del bad["output"]["cap"]
    with pytest.raises(InputError, match="missing"):
        EngineRun.from_json(bad)
    bad = json.loads(json.dumps(d))
    bad["output"]["decode"]["wait_s"] = "0.5"
    with pytest.raises(InputError, match="wait_s: str"):
        EngineRun.from_json(bad)
    bad = json.loads(json.dumps(d))
    bad["identity"]["repetition"] = True
    with pytest.raises(InputError, match="repetition: bool"):
        EngineRun.from_json(bad)
    with pytest.raises(InputError, match="relayout-colibri-run"):
        RunIdentity.from_json({**run.identity.to_json(), "version": 99})


@settings(max_examples=fuzz_examples(60), deadline=None)
@given(st.lists(st.integers(0, 10**7), min_size=7, max_size=7), st.integers(1, 4096), st.integers(0, 20))
def test_profile_lines_as_the_engine_formats_them_parse_back(ms, tokens, prefix):
    """The engine's own printf formats (``%.3f`` seconds), with text before the line as in merged output."""
    s = [m / 1000 for m in ms]
    line = (f"{'x' * prefix}PROFILE: expert-disk {s[0]:.3f}s service / {s[1]:.3f}s wait | expert-matmul {s[2]:.3f}s | "
            f"attention {s[3]:.3f}s (including kvb {s[4]:.3f}s) | lm_head {s[5]:.3f}s | other {s[6]:.3f}s")
    serve = f"PROF {s[0]:.3f} {tokens} {tokens + 1} {s[1]:.3f} {s[2]:.3f} {s[3]:.3f} {s[4]:.3f} {s[5]:.3f} {tokens + 2}"
    o = parse_engine_output(line + "\n")
    assert o.decode == Profile(*s) and o.prefill is None
    o = parse_engine_output(serve + "\n" + serve + "\n")
    assert len(o.serve_turns) == 2 and o.committed_tokens == 2 * (tokens + 1) and o.wait_s == pytest.approx(2 * s[2])
    assert o.serve_turns[0].forwards == tokens + 2


def test_not_an_engine_output_is_one_error_naming_the_file(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello\n")
    assert not looks_like_engine_output(p)
    with pytest.raises(InputError, match="notes.txt.*not a finished colibrì run"):
        read_run(p)
    bad = tmp_path / "tokens.log"
    bad.write_text("PROFILE: expert-disk 0.1s service / 0.2s wait | expert-matmul 0.3s | attention 0.1s (including kvb "
                   "0.0s) | lm_head 0.0s | other 0.1s\n[TOKENS] 3 generated: 1 2\n")
    with pytest.raises(InputError, match="announces 3 ids and holds 2"):
        read_run(bad)
    empty = tmp_path / "arm"
    empty.mkdir()
    (empty / ".p00-r00.partial").mkdir()
    with pytest.raises(InputError, match="no completed engine runs"):
        read_runs(empty)


def test_report_takes_s_as_summed_wait_over_summed_tokens():
    runs = read_runs(STOCK)
    r = engine_report([STOCK])["arms"][0]
    wait = sum(x.output.decode.wait_s for x in runs)
    tokens = sum(x.output.decode_tokens for x in runs)
    assert r["runs"] == len(runs) == 4 and r["committed_tokens"] == tokens
    assert r["stall_per_committed_token_ms"] == pytest.approx(wait / tokens * 1e3)
    loads = sum(x.output.expert_io.loads for x in runs)
    assert r["loads_per_token"] == pytest.approx(loads / tokens)
    iv = r["stall_per_committed_token_ms_interval"]
    assert iv["low"] <= iv["estimate"] <= iv["high"] or iv["n_units"] < 2
    assert r["arm"] == "baseline" and any("CAP=4" in c for c in r["configurations"])


def test_stock_and_relaid_pair_by_prompt_and_repetition_and_agree_on_tokens():
    c = engine_compare([STOCK, LOUVAIN])
    assert c["correctness_failures"] == []
    x = c["comparisons"][0]
    assert x["pairs"] == 4 and x["pairs_with_output_tokens"] == 4
    base = {r.identity.prompt * 10 + r.identity.repetition: r for r in read_runs(STOCK)}
    new = {r.identity.prompt * 10 + r.identity.repetition: r for r in read_runs(LOUVAIN)}
    per_pair = [(base[k].output.wait_s / base[k].output.committed_tokens
                 - new[k].output.wait_s / new[k].output.committed_tokens) * 1e3 for k in sorted(base)]
    assert sorted(x["per_pair_saving_ms"]) == pytest.approx(sorted(per_pair))
    s = x["saving_ms_per_token"]
    assert s["estimate"] == pytest.approx(x["control_stall_per_committed_token_ms"] - x["treatment_stall_per_committed_token_ms"])


def test_different_output_tokens_are_a_correctness_failure_through_the_cli():
    c = engine_compare([STOCK, SAMPLED])
    assert c["correctness_failures"] and "different tokens" in c["correctness_failures"][0]
    res = _cli("compare", STOCK, SAMPLED)
    assert res.returncode == 2 and "CORRECTNESS FAILURE" in res.stdout and "correctness failure" in res.stderr


def test_report_and_compare_cli_accept_engine_runs_and_say_what_they_count():
    res = _cli("report", STOCK, LOUVAIN)
    assert res.returncode == 0, res.stderr
    assert "S (expert wait per committed token)" in res.stdout and "measured by the colibrì engine" in res.stdout
    assert "[95% CI over runs" in res.stdout
    res = _cli("report", MERGED)
    assert res.returncode == 0 and "insufficient, one run" in res.stdout and "CI" not in res.stdout
    res = _cli("report", "--json", MERGED)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["arms"][0]["runs"] == 1
    res = _cli("compare", STOCK, LOUVAIN)
    assert res.returncode == 0, res.stderr
    assert "run pairs by prompt and repetition or order" in res.stdout


def test_an_unpaired_arm_is_an_error_and_a_lone_run_directory_reads(tmp_path):
    lone = sorted(p for p in STOCK.iterdir() if p.is_dir())[0]
    assert len(read_runs(lone)) == 1
    other = tmp_path / "other"
    shutil.copytree(lone, other / "p09-r09")
    ident = json.loads((other / "p09-r09" / RUN_FILE).read_text())
    ident["prompt"] = 9
    (other / "p09-r09" / RUN_FILE).write_text(json.dumps(ident))
    with pytest.raises(InputError, match="no run pairs"):
        engine_compare([STOCK, other])


def test_engine_output_record_defaults_hold_nothing_invented():
    o = EngineOutput(decode=None, prefill=None, prefill_tokens=None, decode_tokens=None, decode_s=None)
    assert o.committed_tokens is None and o.wait_s is None


def test_directories_of_captured_output_files_pair_by_prompt_tokens(tmp_path):
    for arm in ("stock", "relaid"):
        (tmp_path / arm).mkdir()
        shutil.copy(MERGED, tmp_path / arm / "run1.log")
    c = engine_compare([tmp_path / "stock", tmp_path / "relaid"])
    x = c["comparisons"][0]
    assert x["pairs"] == 1 and c["correctness_failures"] == [] and x["saving_ms_per_token"]["estimate"] == 0
    assert x["treatment_arm"] == str(tmp_path / "relaid")
