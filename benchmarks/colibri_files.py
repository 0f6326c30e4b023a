"""A rewrite as colibrì sees it: format stamps, model index, shard names, runtime files, tokens.

Usage: python benchmarks/colibri_files.py MODEL_DIR --colibri CHECKOUT --work DIR [--shard-mb 100] [--ngen 24]

MODEL_DIR is a GLM (``glm_moe_dsa``) container colibrì's engine runs, as its converter wrote it
(read only; copied). The copy, SRC, is given what the converter does not write: a
``__metadata__["colibri.fmt"]`` stamp for every quantised tensor that is not a routed expert
(its format from its shape in ``config.json`` and its byte counts, as colibrì's engine infers it;
the engine refuses a stamp that disagrees) and a ``model.safetensors.index.json``. Then, with
the engine built at ``CHECKOUT/c/colibri``:

1. a greedy run on SRC with ROUTE_TRACE (its routing becomes the plan's training trace);
2. ``relayout trace import``, ``manifest``, ``plan --shard-mb``, ``rewrite --force --verify``
   into DST (several shards);
3. ``coli doctor --deep --json`` on SRC and DST: the overall status and each ``model.*`` check;
4. the same greedy run on DST: generated tokens and the routing trace compared with SRC's;
5. a run on DST with ``PIN=auto``: the runtime seeds its pins from the carried ``.coli_usage``.

Prints one JSON object; exits non-zero when DST's stamps, doctor status, tokens or routing differ
from SRC's. The run's settings: ``TEMP=0 CAP=4 CAP_RAISE=0 AUTOPIN=0 KVSAVE=0``, one prompt.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from containers.container import Container  # noqa: E402
from containers.model_index import INDEX_NAME, index_bytes  # noqa: E402
from containers.safetensors_io import TensorSpec, read_header, write_shard  # noqa: E402
from containers.shard_metadata import with_stamps  # noqa: E402
from containers.sources import FileRange  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog."
RUN_ENV = {"TEMP": "0", "PROF": "1", "TOKENS": "1", "COLI_NO_OMP_TUNE": "1", "CAP": "4", "CAP_RAISE": "0",
           "AUTOPIN": "0", "KVSAVE": "0"}


def glm_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """``[rows, cols]`` of each resident projection of a GLM (``glm_moe_dsa``) layer, by name suffix."""
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    shared = cfg["moe_intermediate_size"] * cfg.get("n_shared_experts", 0)
    return {
        "self_attn.q_a_proj.weight": (cfg["q_lora_rank"], H),
        "self_attn.q_b_proj.weight": (heads * (nope + rope), cfg["q_lora_rank"]),
        "self_attn.kv_a_proj_with_mqa.weight": (cfg["kv_lora_rank"] + rope, H),
        "self_attn.kv_b_proj.weight": (heads * (nope + v), cfg["kv_lora_rank"]),
        "self_attn.o_proj.weight": (H, heads * v),
        "mlp.gate_proj.weight": (cfg["intermediate_size"], H),
        "mlp.up_proj.weight": (cfg["intermediate_size"], H),
        "mlp.down_proj.weight": (H, cfg["intermediate_size"]),
        "mlp.shared_experts.gate_proj.weight": (shared, H),
        "mlp.shared_experts.up_proj.weight": (shared, H),
        "mlp.shared_experts.down_proj.weight": (H, shared),
        "embed_tokens.weight": (cfg["vocab_size"], H),
        "lm_head.weight": (cfg["vocab_size"], H),
    }


def format_of(rows: int, cols: int, weight_bytes: int, scale_bytes: int) -> str | None:
    """colibrì's name of the format these byte counts give a ``[rows, cols]`` matrix (None: no match).

    One scale per row is ``-row`` even when a group would cover the row (colibrì infers so)."""
    scales = scale_bytes // 4
    if weight_bytes == rows * math.ceil(cols / 2):
        if scales == rows:
            return "int4-row"
        return "int4-grouped" if scales % rows == 0 and scales > rows else None
    if weight_bytes == rows * cols and scales == rows:
        return "int8-row"
    return None


def stamp_and_index(model: Path) -> int:
    """Stamp every shard's resident quantised tensors and write the index; returns the stamp count."""
    cfg = json.loads((model / "config.json").read_text())
    shapes = glm_shapes(cfg)
    count, weight_map, total = 0, {}, 0
    for path in sorted(model.glob("*.safetensors")):
        h = read_header(path)
        stamps = {}
        for name, t in h.tensors.items():
            qs = h.tensors.get(name + ".qs")
            shape = next((s for suffix, s in shapes.items() if name.endswith(suffix)), None)
            if qs is None or shape is None or ".experts." in name:
                continue
            fmt = format_of(*shape, t.nbytes, qs.nbytes)
            if fmt:
                stamps[name] = fmt
        old = path.with_name("." + path.name + ".unstamped")
        os.replace(path, old)
        specs = [TensorSpec(t.name, t.dtype, t.shape, FileRange(old, t.begin, t.nbytes), 1) for t in h.by_offset()]
        write_shard(path, specs, alignment=8, metadata=with_stamps({**h.metadata, "format": "pt"}, stamps))
        old.unlink()
        count += len(stamps)
        for t in h.tensors.values():
            weight_map[t.name] = path.name
            total += t.nbytes
    (model / INDEX_NAME).write_bytes(index_bytes({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return count


def relayout(*args) -> str:
    res = subprocess.run([sys.executable, "-m", "relayout", *map(str, args)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    if res.returncode:
        sys.exit(f"relayout {' '.join(map(str, args))} failed:\n{res.stderr}")
    return res.stdout


def engine(colibri: Path, model: Path, ngen: int, trace: Path | None, extra: dict | None = None) -> dict:
    env = dict(os.environ, SNAP=str(model), PROMPT=PROMPT, NGEN=str(ngen), **RUN_ENV, **(extra or {}))
    if trace:
        env["ROUTE_TRACE"] = str(trace)
    res = subprocess.run([str(colibri / "c" / "colibri"), "4"], env=env, capture_output=True, text=True, errors="replace",
                         timeout=3600)
    tokens = re.search(r"\[TOKENS\] \d+ generated: ([0-9 ]+)", res.stderr)
    pin = re.search(r"\[PIN\] auto: seeding from (\S+)", res.stderr)
    return {"returncode": res.returncode, "tokens": tokens.group(1).split() if tokens else None,
            "pin_seed": pin.group(1) if pin else None, "stderr_tail": res.stderr.strip().splitlines()[-1:] if res.returncode else []}


def doctor(colibri: Path, model: Path) -> dict:
    res = subprocess.run([sys.executable, str(colibri / "c" / "coli"), "doctor", "--deep", "--json", "--model", str(model)],
                         capture_output=True, text=True, timeout=600)
    r = json.loads(res.stdout)
    return {"status": r["status"], "checks": {c["id"]: c["status"] for c in r["checks"] if c["id"].startswith("model.")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--colibri", type=Path, required=True, help="a colibrì checkout with c/colibri built")
    ap.add_argument("--work", type=Path, required=True, help="a new directory for SRC, DST and the runs")
    ap.add_argument("--shard-mb", type=float, default=100)
    ap.add_argument("--ngen", type=int, default=24)
    a = ap.parse_args()
    a.work.mkdir(parents=True)
    src, dst = a.work / "src", a.work / "dst"
    src.mkdir()
    for p in a.model.iterdir():
        if p.is_file() and (p.suffix == ".safetensors" or p.name in ("config.json", "tokenizer.json", ".coli_usage", ".coli_kv")):
            shutil.copy2(p, src / p.name)
    stamps = stamp_and_index(src)
    run_src = engine(a.colibri, src, a.ngen, a.work / "src.route")
    relayout("trace", "import", a.work / "src.route", "-o", a.work / "src.rt")
    relayout("manifest", src)
    relayout("plan", "--trace", a.work / "src.rt", "--container", src, "-o", a.work / "plan.json",
             "--shard-mb", a.shard_mb, "--train-fraction", "1.0")
    rewrite = relayout("rewrite", src, "--layout", a.work / "plan.json", "--out", dst, "--force", "--verify")
    doc_src, doc_dst = doctor(a.colibri, src), doctor(a.colibri, dst)
    run_dst = engine(a.colibri, dst, a.ngen, a.work / "dst.route")
    pin = engine(a.colibri, dst, 2, None, {"PIN": "auto"})
    same_routing = (a.work / "src.route").read_bytes() == (a.work / "dst.route").read_bytes()
    out = {
        "stamps_src": stamps, "stamps_dst": len(Container.open(dst).stamps),
        "files_src": len(list(src.glob("*.safetensors"))), "files_dst": sorted(p.name for p in dst.glob("*.safetensors")),
        "rewrite_summary": [l.strip() for l in rewrite.splitlines() if l.startswith("  ")],
        "doctor_src": doc_src, "doctor_dst": doc_dst,
        "tokens_src": run_src["tokens"], "tokens_dst": run_dst["tokens"], "identical_tokens": run_src["tokens"] == run_dst["tokens"],
        "identical_route_trace": same_routing, "pin_auto_seed": pin["pin_seed"],
        "engine_failures": [r["stderr_tail"] for r in (run_src, run_dst, pin) if r["returncode"]],
    }
    print(json.dumps(out, indent=1))
    ok = (out["stamps_dst"] == stamps and doc_src == doc_dst and out["identical_tokens"] and run_src["tokens"]
          and same_routing and not out["engine_failures"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
