"""The container commands: ``inspect``, ``manifest``, ``rewrite`` and ``verify``. Each reads its
arguments, calls :mod:`containers` or :mod:`relayout.workflows.apply` and prints the answer; ``drives`` and
``mirror`` are in :mod:`relayout.cli.commands_drives`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from containers.container import MANIFEST_NAME, Container
from containers.errors import InputError
from containers.manifest import build_manifest, check_container, write_manifest

from relayout.render.containers import format_inspect
from .output import print_rewrite_files, say, verify_and_report


def cmd_inspect(args) -> int:
    container = Container.open(args.dir)
    report = container.report()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_inspect(report))
    if report["problems"]:
        print(f"relayout: error: {args.dir}: {len(report['problems'])} problem(s) found", file=sys.stderr)
        return 2
    return 0


def cmd_manifest(args) -> int:
    root = Path(args.dir)
    if args.check:
        problems = check_container(root, args.output)
        if problems:
            for p in problems:
                print(p)
            print(f"relayout: error: {root}: {len(problems)} mismatch(es) against the manifest", file=sys.stderr)
            return 2
        print(f"{root}: every file and tensor matches the manifest")
        return 0
    container = Container.open(root)
    container.require_clean()
    manifest = build_manifest(container)
    out = Path(args.output) if args.output else root / MANIFEST_NAME
    write_manifest(manifest, out)
    print(f"wrote {out}: {len(manifest['files'])} files, {len(manifest['tensors'])} tensors, "
          f"fingerprint {manifest['fingerprint']}")
    return 0


def cmd_rewrite(args) -> int:
    from replay.formats.gatefile import load_gate
    from replay.formats.planfile import load_plan

    from relayout.workflows.apply import apply_plan

    plan = load_plan(args.layout)
    gate = load_gate(args.gate) if args.gate else None
    split = []
    if args.storage:
        from replay.model.storage import load_storage

        from relayout.workflows.apply import split_of_storage

        record, _ = load_storage(args.storage)
        split = split_of_storage(record, plan, args.dirs, args.storage)
        if record.mirrors:
            say(f"{args.storage} also describes {len(record.mirrors)} mirror(s): stage them after the rewrite with relayout mirror stage")
    elif args.dirs:
        raise InputError(None, "--dirs needs --storage (the description naming each directory's shards)")
    m = apply_plan(args.src, plan, args.out, gate, args.force, args.manifest, notify=say, gate_path=args.gate, split=split)
    forced = " (gate overridden with --force; recorded in the manifest)" if m["rewrite"]["forced"] else ""
    print(f"wrote {args.out}: {len(m['files'])} files, {len(m['tensors'])} tensors, content fingerprint "
          f"{m['content_fingerprint']} (source {m['rewrite']['source_content_fingerprint']}){forced}")
    for d, shards in split:
        print(f"  {d}: {len(shards)} shard(s) of the split")
    if split:
        print(f"  engine variables: SNAP={args.out} COLI_MODEL_DIRS={';'.join(d for d, _ in split)}")
    print_rewrite_files(args.out, m, [d for d, _ in split])
    status = verify_and_report(args.src, args.out, False, False, [d for d, _ in split]) if args.verify else 0
    if status == 0:
        print("\n" + rewrite_bottom_line(args.src, args.out, [d for d, _ in split], bool(m["rewrite"]["forced"]),
                                          args.verify))
    return status


def rewrite_bottom_line(src: str, out: str, dirs: list[str], forced: bool, verified: bool) -> str:
    """The rewrite's answer in words: where the new container is, how far it was checked, and
    how to run and measure it against the source."""
    engine = f"SNAP={out}" + (f" COLI_MODEL_DIRS={';'.join(dirs)}" if dirs else "")
    checked = ("every source tensor was hashed against the source's manifest as it was copied, and verify "
               "found the new files whole" if verified else
               "every source tensor was hashed against the source's manifest as it was copied; "
               f"`relayout verify {src} {out} --full` checks every byte again")
    return (f"Bottom line: {out} is the relaid container{' (the gate overridden with --force)' if forced else ''}; "
            f"{checked}. Run colibrì with {engine} and the settings you measured with, then measure it against "
            f"the source: relayout measure --engine PATH/TO/colibri --baseline {src} --container {out} "
            f"--prompts prompts.txt --reps 3 -o runs, and relayout compare runs/baseline runs/container.")


def cmd_verify(args) -> int:
    return verify_and_report(args.src, args.dst, args.full, args.json, args.dirs)
