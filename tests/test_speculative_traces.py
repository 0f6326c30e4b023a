"""ROUTE_TRACE files of speculative colibrì runs: forwards, evaluated positions and committed tokens
as the engine counts them, and ``export coli-pairs`` as colibrì's own ``tools/route_pairs.py``.

Real runs (tests/data/colibri, see its README) are checked against the counts the engine printed;
traces built here follow the engine's decode loop call by call (prefill, the MTP head's absorb and
draft calls, verify steps, n-gram drafts, the three ways a run ends).
"""

import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from conftest import cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from containers.errors import InputError
from relayout.planning.coactivation import write_coli_pairs
from relayout.traces.runtime_output import read_runtime_output
from relayout.traces.importer import import_traces
from replay.model.routing import FORWARD_KINDS

DATA = Path(__file__).resolve().parent / "data" / "colibri"

RUNS = {
    # run: (decode forwards, tokens, MTP head layer, prompt tokens, the trace alone knows every count)
    "plain": (19, 20, None, 12, True),
    "draft3": (17, 20, None, 12, False),
    "mtp": (15, 20, 5, 12, True),
    "mtp_d2": (13, 20, 5, 12, True),
    "mtp_p1": (21, 30, 5, 1, True),
}
"""The engine's counts, as its stdout states them (``... (N forwards per T tokens)``)."""

PREFILL = FORWARD_KINDS.index("prefill")


# ------------------------------------------------------------------ colibrì's route_pairs rules


def reference_pairs(texts: list[str]) -> dict:
    """``.coli_pairs`` counts by the rules of colibrì's ``tools/route_pairs.py``, re-expressed: in
    each file a forward ends where the layer number goes down; a (forward, row) holds, per layer,
    the ids of the last line that wrote it; for each such position, every expert e at layer L and
    f at L+dL (dL 1 or 2) count once. Returns ``{(L, dL, e): {f: count}}``."""
    counts: dict = defaultdict(Counter)
    for text in texts:
        positions: dict = defaultdict(dict)
        forward, previous = 0, None
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            row, layer = int(parts[1]), int(parts[2])
            if previous is not None and layer < previous:
                forward += 1
            previous = layer
            positions[forward, row][layer] = [int(t.split(":")[0]) for t in parts[3:]]
        for by_layer in positions.values():
            for layer, ids in by_layer.items():
                for dl in (1, 2):
                    for e in ids:
                        for f in by_layer.get(layer + dl, ()):
                            counts[layer, dl, e][f] += 1
    return {key: dict(c) for key, c in counts.items()}


def read_pairs(path: Path) -> dict:
    """A ``.coli_pairs`` file as ``{(L, dL, e): {f: count}}`` (target order, i.e. ties, dropped)."""
    lines = path.read_text().splitlines()
    head = lines[0].split()
    assert head[:2] == ["COLIPAIRS", "1"] and int(head[2]) == len(lines) - 1
    out = {}
    for line in lines[1:]:
        parts = line.split()
        targets = [t.split(":") for t in parts[3:]]
        counts = [int(c) for _, c in targets]
        assert counts == sorted(counts, reverse=True)
        out[tuple(int(x) for x in parts[:3])] = {int(f): int(c) for f, c in targets}
    return out


def exported_pairs(tmp_path: Path, paths: list[Path]) -> dict:
    trace, _ = import_traces(paths)
    out = tmp_path / "out.coli_pairs"
    write_coli_pairs(trace, out)
    return read_pairs(out)


# ------------------------------------------------------------------ traces shaped as the engine writes them


def engine_run(seed: int, prompt: int, tokens: int, head: int | None, depth: int, accept: float, stop: str, *,
               layers=(3, 4), experts: int = 8):
    """One session of colibrì's speculative decode loop, as ROUTE_TRACE text.

    The prefill routes ``prompt`` rows through every layer; with an MTP head (layer ``head``)
    the head then absorbs the prompt's ``prompt - 1`` verified pairs. Each step emits the token
    the last forward predicted, then (unless that was the last token and the caller keeps no
    KV: ``stop`` "limit") drafts: the MTP head ``depth`` calls of one row, or n-gram drafts
    (0..depth, no routing); the drafts are cut to the tokens left; the verify forward routes
    1 + drafts rows; the drafts are accepted in order while a coin says so; the head absorbs the
    accepted ones (one call, a row each). ``stop`` "kv": the caller keeps the KV cache, so the
    last token is forwarded too (drafts cut to 0); "eos": the model's end token ends the run at
    a random point (not emitted).

    Returns ``(text, decode forwards, tokens emitted, committed tokens per forward,
    evaluated positions per forward)``.
    """
    rng = np.random.default_rng(seed)
    lines: list[str] = []
    call = 0

    def moe(layer: int, rows: int):
        nonlocal call
        for r in range(rows):
            ids = rng.choice(experts, size=2, replace=False)
            lines.append(f"{call} {r} {layer} " + " ".join(f"{e}:{g:.4f}" for e, g in zip(ids, rng.random(2))))
        call += 1

    def forward(rows: int):
        for layer in layers:
            moe(layer, rows)

    forward(prompt)
    if head is not None and prompt >= 2:
        moe(head, prompt - 1)
    committed, evaluated = [1], [prompt]
    emitted = forwards = 0
    eos_at = int(rng.integers(1, tokens + 1)) if stop == "eos" else -1
    pending = True          # the last forward's prediction is not emitted yet
    done = False
    while emitted < tokens and not done:
        if emitted == eos_at:
            break
        emitted += 1
        pending = False
        if emitted >= tokens and stop != "kv":
            break
        if head is not None:
            for _ in range(depth):
                moe(head, 1)
            g = depth
        else:
            g = int(rng.integers(0, depth + 1))
        g = min(g, tokens - emitted)
        forward(1 + g)
        forwards += 1
        k = 0
        while k < g and emitted < tokens:
            if rng.random() >= accept:
                break
            if emitted == eos_at:
                done = True
                break
            emitted += 1
            k += 1
        if head is not None and k >= 1:
            moe(head, k)
        committed.append(1 + k)
        evaluated.append(1 + g)
        pending = True
    if pending:
        committed[-1] -= 1
    return "\n".join(lines) + "\n", forwards, emitted, committed, evaluated


def engine_stdout(style: str, forwards: int, tokens: int, head: int | None, depth: int, n_layers: int) -> str:
    """What colibrì prints about such a run, in one of its modes' formats."""
    per = tokens / forwards if forwards else 1.0
    style = style if forwards else "oracle"          # PROF prints no forward line for a run without one
    draft = depth if head is not None or style != "plain" else 0
    mtp = "ACTIVE" if head is not None else "absent"
    loaded = f"loaded in 0.01s | resident dense: 1.91 MB | layers={n_layers} experts=8 | MTP {mtp} (draft={draft})\n"
    if style == "oracle":
        return (loaded + f"\nMatching tokens: {tokens}/{tokens}\n"
                f"N-gram speculation (DRAFT={draft}): {per:.2f} tokens/forward ({forwards} forwards per {tokens} tokens)\n")
    if style == "text":
        return (loaded + f"prompt: 12 tokens | generating up to {tokens} (EOS stop=1) | n-gram draft={draft}\n"
                f"speculation: {per:.2f} tokens/forward ({forwards} forwards per {tokens} tokens) | MTP acceptance 50% (1/2)\n")
    return loaded + (f"[PROF] decode forwards: {forwards} | latency p50 0.2 ms | p90 0.2 ms | p99 0.2 ms | max 0.3 ms | "
                     f"{per:.2f} tok/forward\n")


# ------------------------------------------------------------------ real runs


@pytest.mark.parametrize("run", sorted(RUNS))
def test_real_run_counts_are_the_engines(tmp_path, run):
    fw, tokens, head, prompt, exact = RUNS[run]
    printed = read_runtime_output(DATA / f"{run}.stdout")
    assert (printed.forwards, printed.tokens, printed.n_layers) == (fw, tokens, 5)
    assert printed.mtp == (head is not None)
    for runtime in (None, [DATA / f"{run}.stdout"]):
        tr, warnings = import_traces([DATA / f"{run}.route"], runtime_outputs=runtime)
        assert warnings == []
        kinds = [FORWARD_KINDS[k] for k in tr.fwd_kind]
        assert tr.n_forwards == fw + 1 and kinds[0] == "prefill" and kinds.count("prefill") == 1
        # evaluated positions: the main model's rows (its routed layers 3 and 4 route every one)
        assert tr.fwd_evaluated[0] == prompt
        assert int(tr.fwd_evaluated.sum()) == len(tr.layer_rows(3)) == len(tr.layer_rows(4))
        assert (tr.fwd_committed <= tr.fwd_evaluated).all()
        if runtime or exact:
            assert int(tr.fwd_committed.sum()) == tokens
        else:
            assert int(tr.fwd_committed.sum()) == fw + 1    # every verify step at its minimum, 1
            assert tr.meta["committed_assumed"]["forwards"] == kinds.count("verify") == 4
        assert ("committed_assumed" in tr.meta) == (head is None and kinds.count("verify") > 0)
        if head is not None:
            assert tr.meta["session_counts"][f"{run}.route"]["mtp_layers"] == [head]
            assert tr.layers.tolist() == [3, 4, head]


def test_real_mtp_run_commits_its_absorbed_drafts():
    # prefill, then 15 verify steps of 2 rows; 4 of their drafts were absorbed (accepted)
    tr, _ = import_traces([DATA / "mtp.route"])
    assert tr.fwd_evaluated.tolist() == [12] + [2] * 15
    assert sorted(Counter(tr.fwd_committed[1:].tolist()).items()) == [(1, 11), (2, 4)]
    # the head's rows: 11 absorbed at the prefill, 1 draft before every step, 4 absorbed after them
    assert len(tr.layer_rows(5)) == 11 + 15 + 4


def test_real_draft_run_tokens_come_from_the_runtime_output():
    tr, _ = import_traces([DATA / "draft3.route"], runtime_outputs=[DATA / "draft3.stdout"])
    verify = tr.fwd_kind == FORWARD_KINDS.index("verify")
    assert tr.fwd_evaluated[verify].tolist() == [3, 4, 4, 3]
    assert int(tr.fwd_committed[~verify].sum()) == 14 and int(tr.fwd_committed[verify].sum()) == 6
    info = tr.meta["committed_assumed"]
    assert info["forwards"] == 4 and info["tokens"] == 6 and "runtime output" in info["reason"]
    assert tr.meta["committed_from_runtime_output"] == ["draft3.route"]
    assert tr.meta["session_counts"]["draft3.route"]["tokens"] == 20


@pytest.mark.parametrize("run", sorted(RUNS) + ["serve_plain", "serve_mtp"])
def test_real_run_coli_pairs_are_route_pairs(tmp_path, run):
    path = DATA / f"{run}.route"
    assert exported_pairs(tmp_path, [path]) == reference_pairs([path.read_text()])


def test_real_runs_in_one_table_are_route_pairs(tmp_path):
    paths = [DATA / f"{run}.route" for run in ("mtp", "plain", "mtp_p1")]
    assert exported_pairs(tmp_path, paths) == reference_pairs([p.read_text() for p in paths])


def test_a_runtime_output_of_another_run_is_refused(tmp_path):
    with pytest.raises(InputError, match="mtp.stdout: says the MTP head drafted; .*draft3.route has no MTP head's calls"):
        import_traces([DATA / "draft3.route"], runtime_outputs=[DATA / "mtp.stdout"])
    with pytest.raises(InputError, match="mtp_p1.stdout: reports 21 decode forwards; .*mtp.route has 15"):
        import_traces([DATA / "mtp.route"], runtime_outputs=[DATA / "mtp_p1.stdout"])
    with pytest.raises(InputError, match="plain.stdout: counts one prompt; .*draft3.route has 3"):
        import_traces([DATA / "draft3.route"], runtime_outputs=[DATA / "plain.stdout"])
    with pytest.raises(InputError, match="one per input"):
        import_traces([DATA / "mtp.route", DATA / "plain.route"], runtime_outputs=[DATA / "mtp.stdout"])
    # same forwards, more tokens than the steps can commit
    other = tmp_path / "other.stdout"
    other.write_text("N-gram speculation (DRAFT=1): 9.00 tokens/forward (15 forwards per 99 tokens)\n")
    # (no 'loaded ...' line: the output does not say whether an MTP head drafted)
    with pytest.raises(InputError, match="reports 99 tokens; .*mtp.route's forwards commit 19..20"):
        import_traces([DATA / "mtp.route"], runtime_outputs=[other])


# ------------------------------------------------------------------ built traces


SHAPES = st.tuples(
    st.integers(0, 2**31 - 1),                      # seed
    st.integers(1, 9),                              # prompt tokens
    st.integers(1, 24),                             # tokens to generate
    st.sampled_from(["mtp", "ngram", "plain"]),
    st.integers(1, 3),                              # draft depth
    st.sampled_from([0.0, 0.5, 0.9, 1.0]),          # acceptance
    st.sampled_from(["limit", "kv", "eos"]),
    st.sampled_from(["oracle", "text", "prof"]),
)


def built_run(tmp_path: Path, shape):
    seed, prompt, tokens, mode, depth, accept, stop, style = shape
    head = 5 if mode == "mtp" else None
    text, fw, emitted, committed, evaluated = engine_run(seed, prompt, tokens, head, depth if mode != "plain" else 0,
                                                         accept, stop)
    trace = tmp_path / "run.route"
    trace.write_text(text)
    out = tmp_path / "run.stdout"
    out.write_text(engine_stdout(style if mode != "plain" else "oracle", fw, emitted, head, depth if mode != "plain" else 0, 5))
    return trace, out, fw, emitted, committed, evaluated, head


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(SHAPES)
def test_built_runs_import_with_the_engines_counts(tmp_path, shape):
    trace, out, fw, emitted, committed, evaluated, head = built_run(tmp_path, shape)
    alone, _ = import_traces([trace])
    given_out, _ = import_traces([trace], runtime_outputs=[out])
    for tr in (alone, given_out):
        assert tr.n_forwards == fw + 1 and int((tr.fwd_kind != PREFILL).sum()) == fw
        assert tr.fwd_evaluated.tolist() == evaluated
        assert (tr.fwd_committed <= tr.fwd_evaluated).all()
    assert int(given_out.fwd_committed.sum()) == emitted
    verify = alone.fwd_kind == FORWARD_KINDS.index("verify")
    if head is not None or not verify.any():
        # the runtime output names the MTP head: every count is known
        assert given_out.fwd_committed.tolist() == committed and "committed_assumed" not in given_out.meta
        if "committed_assumed" not in alone.meta:
            # the trace alone knows every count but whether the last forward's prediction was emitted
            assert alone.fwd_committed[:-1].tolist() == committed[:-1]
            assert alone.fwd_committed[-1] - committed[-1] in (0, 1)
        else:
            # a head whose calls never show as one (a 1-token prompt, no draft accepted, no row count
            # setting it apart) leaves its verify steps' acceptance unknown, and says so
            assert head is not None and "session_counts" not in alone.meta
            assert alone.meta["committed_assumed"]["forwards"] == int(verify.sum())
    else:
        assert alone.fwd_committed[verify].tolist() == [1] * int(verify.sum())
        assert alone.meta["committed_assumed"]["forwards"] == int(verify.sum())
        # decode steps are known; the verify steps share the rest
        known = ~verify
        known[-1] = False
        assert given_out.fwd_committed[known].tolist() == np.array(committed)[known].tolist()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(SHAPES)
def test_built_runs_coli_pairs_are_route_pairs(tmp_path, shape):
    trace, *_ = built_run(tmp_path, shape)
    assert exported_pairs(tmp_path, [trace]) == reference_pairs([trace.read_text()])


def test_an_mtp_head_the_trace_cannot_show_is_taken_from_the_geometry(tmp_path):
    # a 1-token prompt (no absorb after the prefill), one draft, rejected: the head's one call looks
    # like a main layer's (one row after one-row calls), so only the geometry (or the runtime
    # output) names its layer
    text, fw, emitted, committed, evaluated = engine_run(3, 1, 2, 5, 1, 0.0, "limit")
    assert (fw, emitted, committed) == (1, 2, [1, 1])
    p = tmp_path / "run.route"
    p.write_text(text)
    bare, _ = import_traces([p])
    assert bare.n_forwards == fw + 1 and "committed_assumed" in bare.meta
    tr, _ = import_traces([p], n_experts=8, geometry="custom", routed_layers=[3, 4, 5], mtp_layers=[5])
    assert tr.fwd_committed.tolist() == committed and "committed_assumed" not in tr.meta
    out = tmp_path / "run.stdout"
    out.write_text(engine_stdout("text", fw, emitted, 5, 1, 5))
    tr, _ = import_traces([p], runtime_outputs=[out])
    assert tr.fwd_committed.tolist() == committed and "committed_assumed" not in tr.meta
    # a shipped geometry names its MTP layer: GLM-5.2's layer 78, after routed layers 3..77
    text, fw, emitted, committed, evaluated = engine_run(3, 1, 2, 78, 1, 0.0, "limit", layers=range(3, 78), experts=256)
    p.write_text(text)
    assert "committed_assumed" in import_traces([p])[0].meta
    tr, _ = import_traces([p], n_experts=256, geometry="glm-5.2-int4-row")
    assert tr.fwd_committed.tolist() == committed and "committed_assumed" not in tr.meta
    assert tr.meta["session_counts"]["run.route"]["mtp_layers"] == [78]


# ------------------------------------------------------------------ the runtime output


def test_runtime_output_lines(tmp_path):
    p = tmp_path / "o.txt"
    p.write_text("[PROF] decode forwards: 44 | latency p50 1.0 ms | p90 1.0 ms | p99 1.0 ms | max 1.0 ms | 1.09 tok/forward\n")
    c = read_runtime_output(p)
    assert (c.forwards, c.tokens) == (44, 48)          # 48/44 = 1.0909: the one integer that prints 1.09
    p.write_text("[PROF] decode forwards: 400 | latency p50 1.0 ms | p90 1.0 ms | p99 1.0 ms | max 1.0 ms | 1.09 tok/forward\n")
    assert (read_runtime_output(p).forwards, read_runtime_output(p).tokens) == (400, None)   # 434..437 all print 1.09
    p.write_text("Matching tokens: 3/32\n")
    assert read_runtime_output(p).tokens == 32 and read_runtime_output(p).forwards is None
    p.write_text("speculation: 1.09 tokens/forward (44 forwards per 48 tokens) | MTP acceptance 9% (4/44)\n"
                 "[PROF] decode forwards: 45 | latency p50 1.0 ms | p90 1.0 ms | p99 1.0 ms | max 1.0 ms | 1.07 tok/forward\n")
    with pytest.raises(InputError, match="says 44 decode forwards .* and 45"):
        read_runtime_output(p)
    p.write_text("prefill 12 tokens in 0.10s\n")
    with pytest.raises(InputError, match="no run counts found"):
        read_runtime_output(p)


def test_cli_import_with_runtime_output(tmp_path):
    out = tmp_path / "d.rt"
    res = cli("trace", "import", DATA / "draft3.route", "--runtime-output", DATA / "draft3.stdout", "-o", out)
    assert res.returncode == 0, res.stderr
    stats = cli("trace", "stats", out)
    assert stats.returncode == 0
    assert "17 decode forwards (colibrì's count: the prefill excluded) per 20 tokens" in stats.stdout, stats.stdout
    assert "runtime output in 1 of 1 sessions" in stats.stdout and "6 of 20 committed tokens (4 forwards)" in stats.stdout
    bad = cli("trace", "import", DATA / "draft3.route", "--runtime-output", DATA / "mtp.stdout", "-o", tmp_path / "x.rt")
    assert bad.returncode == 2 and "mtp.stdout" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert "Traceback" not in bad.stderr and not (tmp_path / "x.rt").exists()


# ------------------------------------------------------------------ against colibrì itself


def _route_pairs_tool() -> Path | None:
    root = os.environ.get("RELAYOUT_COLIBRI_DIR")
    if not root:
        return None
    for rel in ("c/tools/route_pairs.py", "tools/route_pairs.py"):
        if (Path(root) / rel).is_file():
            return Path(root) / rel
    return None


@pytest.mark.skipif(_route_pairs_tool() is None, reason="RELAYOUT_COLIBRI_DIR does not name a colibrì checkout")
def test_coli_pairs_equal_colibris_route_pairs(tmp_path):
    tool = _route_pairs_tool()
    built = tmp_path / "built.route"
    built.write_text(engine_run(11, 5, 24, 5, 2, 0.6, "kv")[0])
    cases = ([[DATA / f"{run}.route"] for run in sorted(RUNS) + ["serve_plain", "serve_mtp"]]
             + [[built], [DATA / "mtp.route", DATA / "mtp_d2.route"]])
    for paths in cases:
        theirs = tmp_path / "theirs.coli_pairs"
        subprocess.run([sys.executable, str(tool), str(theirs), *map(str, paths)], check=True, capture_output=True)
        assert exported_pairs(tmp_path, paths) == read_pairs(theirs), paths


# ------------------------------------------------------------------ several prompts in one file


def one_process(tmp_path: Path, runs: list[str]) -> Path:
    """The runs' ROUTE_TRACE lines as one process writes several prompts: one call counter."""
    out, offset = [], 0
    for run in runs:
        last = offset
        for line in (DATA / f"{run}.route").read_text().splitlines():
            call, rest = line.split(" ", 1)
            last = int(call) + offset
            out.append(f"{last} {rest}")
        offset = last + 1
    p = tmp_path / "process.route"
    p.write_text("\n".join(out) + "\n")
    return p


def sessions_of(tr) -> list[tuple[int, int, int]]:
    """(forwards, committed tokens, first forward's evaluated positions) per session."""
    out = []
    for i in range(len(tr.sessions)):
        m = tr.fwd_session == i
        assert FORWARD_KINDS[tr.fwd_kind[m][0]] == "prefill"
        out.append((int(m.sum()), int(tr.fwd_committed[m].sum()), int(tr.fwd_evaluated[m][0])))
    return out


def test_split_at_each_prompt(tmp_path):
    p = one_process(tmp_path, ["plain", "plain"])
    whole, _ = import_traces([p])
    assert len(whole.sessions) == 1 and whole.n_forwards == 40
    tr, _ = import_traces([p], split="prefill")
    assert tr.sessions == ["process.route#1", "process.route#2"] and sessions_of(tr) == [(20, 20, 12)] * 2
    # MTP: each prompt's prefill, absorb and drafts start its session; counts as in each run alone
    tr, _ = import_traces([one_process(tmp_path, ["mtp", "mtp"])], split="prefill")
    assert sessions_of(tr) == [(16, 20, 12)] * 2 and "committed_assumed" not in tr.meta
    alone, _ = import_traces([DATA / "mtp.route"])
    assert tr.fwd_committed[tr.fwd_session == 1].tolist() == alone.fwd_committed.tolist()
    # n-gram drafts: the run's draft depth (its output) tells a verify step from a prompt
    p = one_process(tmp_path, ["draft3", "draft3"])
    tr, _ = import_traces([p], split="prefill", runtime_outputs=[DATA / "draft3.stdout"])
    assert sessions_of(tr) == [(18, 18, 12)] * 2 and tr.meta["committed_assumed"]["forwards"] == 8
    assert "committed_from_runtime_output" not in tr.meta      # its counts are one prompt's, not the file's
    blind, _ = import_traces([p], split="prefill")
    assert len(blind.sessions) > 2                              # without it, verify steps read as prompts


def test_split_every_n_tokens(tmp_path):
    tr, _ = import_traces([DATA / "mtp.route"], split=6)
    whole, _ = import_traces([DATA / "mtp.route"])
    assert tr.fwd_committed.tolist() == whole.fwd_committed.tolist() and tr.n_rows == whole.n_rows
    per = [int(tr.fwd_committed[tr.fwd_session == i].sum()) for i in range(len(tr.sessions))]
    assert sum(per) == 20 and len(per) == 4
    ends = np.cumsum(per)[:-1]
    cum = np.cumsum(whole.fwd_committed)
    # each piece ends with the forward whose tokens reach the next multiple of 6
    for e in ends:
        f = int(np.flatnonzero(cum == e)[0])
        assert e // 6 > (cum[f - 1] // 6 if f else 0)
    assert tr.meta["session_counts"]["mtp.route#2"]["piece"] == "2 of 4"
    res = cli("trace", "import", DATA / "mtp.route", "--split", "0", "-o", tmp_path / "o.rt")
    assert res.returncode == 2 and "--split" in res.stderr and not (tmp_path / "o.rt").exists()
    res = cli("trace", "import", DATA / "mtp.route", "--split", "prefill", "-o", tmp_path / "o.rt")
    assert res.returncode == 0 and "1 session(s)" in res.stdout


# ------------------------------------------------------------------ a serve process: several prompts, one file


def serve_output(tmp_path: Path, run: str, with_stderr: bool = True) -> Path:
    """The serve run's stdout, and its stderr (where PROF=1 writes each turn's forwards) after it."""
    p = tmp_path / f"{run}.out"
    p.write_bytes((DATA / f"{run}.stdout").read_bytes() + ((DATA / f"{run}.stderr").read_bytes() if with_stderr else b""))
    return p


@pytest.mark.parametrize("run, turns, tokens, prompts", [("serve_plain", 3, 8, [72, 61, 51]), ("serve_mtp", 2, 10, [72, 61])])
def test_real_serve_process_splits_into_its_turns(tmp_path, run, turns, tokens, prompts):
    out = serve_output(tmp_path, run)
    printed = read_runtime_output(out)
    assert printed.turns == ((tokens, tokens),) * turns
    tr, _ = import_traces([DATA / f"{run}.route"], split="prefill", runtime_outputs=[out])
    assert sessions_of(tr) == [(tokens + 1, tokens, p) for p in prompts]
    # a turn's last forward only writes its last token to the KV cache: it commits nothing
    for i in range(turns):
        assert tr.fwd_committed[tr.fwd_session == i][-1] == 0
    assert tr.meta["session_counts"][f"{run}.route#2"]["runtime_output"] == f"{run}.out (turn 2)"
    # the trace alone: every forward's token counted (the KV-only step's too), no turn merged or cut
    alone, _ = import_traces([DATA / f"{run}.route"], split="prefill")
    assert sessions_of(alone) == [(tokens + 1, tokens + 1, p) for p in prompts]
    # stdout alone holds each turn's tokens, not its forwards
    only_stdout = read_runtime_output(serve_output(tmp_path, run, with_stderr=False))
    assert only_stdout.turns == ((None, tokens),) * turns
    tr, _ = import_traces([DATA / f"{run}.route"], split="prefill", runtime_outputs=[serve_output(tmp_path, run, False)])
    assert sessions_of(tr) == [(tokens + 1, tokens, p) for p in prompts]
    # not split: one session holding every turn, each counted as its turn
    whole, _ = import_traces([DATA / f"{run}.route"], runtime_outputs=[out])
    assert len(whole.sessions) == 1 and (whole.fwd_kind == PREFILL).sum() == turns
    assert whole.fwd_committed.tolist() == tr.fwd_committed.tolist() and whole.n_rows == tr.n_rows
    assert whole.meta["session_counts"][f"{run}.route"]["prompts"] == turns
    # another process's turns
    other = "serve_mtp" if run == "serve_plain" else "serve_plain"
    with pytest.raises(InputError, match=f"holds {5 - turns} served turns; .*{run}.route has {turns} prompts"):
        import_traces([DATA / f"{run}.route"], split="prefill", runtime_outputs=[serve_output(tmp_path, other)])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**31 - 1), st.integers(2, 4), st.sampled_from(["mtp", "ngram", "plain"]), st.integers(1, 3),
       st.booleans())
def test_built_serve_process_splits_into_its_turns(tmp_path, seed, n_turns, mode, depth, prof):
    """Several turns of a serve process (the caller keeps the KV cache) in one file: split at each
    prompt, each session has its turn's forwards and tokens."""
    rng = np.random.default_rng(seed)
    head = 5 if mode == "mtp" else None
    depth = depth if mode != "plain" else 0
    lines, stdout, turns, offset = [], [], [], 0
    for t in range(n_turns):
        prompt = int(rng.integers(depth + 2, 13))          # wider than a decode step, as a templated prompt is
        text, fw, emitted, committed, evaluated = engine_run(seed + t, prompt, int(rng.integers(1, 12)), head, depth,
                                                             float(rng.choice([0.0, 0.5, 1.0])), "kv")
        last = offset
        for line in text.splitlines():
            call, rest = line.split(" ", 1)
            last = int(call) + offset
            lines.append(f"{last} {rest}")
        offset = last + 1
        turns.append((fw, emitted, committed, prompt))
    p = tmp_path / "serve.route"
    p.write_text("\n".join(lines) + "\n")
    out = tmp_path / "serve.out"
    text = f"loaded in 0.01s | resident dense: 1.91 MB | layers=5 experts=8 | MTP {'ACTIVE' if head else 'absent'} (draft={depth})\n"
    for fw, emitted, _, prompt in turns:
        text += f"\x01\x01END\x01\x01\nSTAT {emitted} 10.00 50.0 0.01 {prompt} 1\n"
    if prof:
        text += "".join(f"[PROF] decode forwards: {fw} | latency p50 0.2 ms | p90 0.2 ms | p99 0.2 ms | max 0.3 ms | "
                        f"{emitted / fw:.2f} tok/forward\n" for fw, emitted, _, _ in turns)
    out.write_text(text)
    tr, _ = import_traces([p], split="prefill", runtime_outputs=[out])
    assert sessions_of(tr) == [(fw + 1, emitted, prompt) for fw, emitted, _, prompt in turns]
    if head is not None or mode == "plain":
        for i, (_, _, committed, _) in enumerate(turns):
            assert tr.fwd_committed[tr.fwd_session == i].tolist() == committed
