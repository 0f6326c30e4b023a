"""The README is the user's guide: its two set-up commands, and a line for every command."""

import re
from pathlib import Path

from relayout.cli.parser import build_parser

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def _commands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return set(sub.choices)


def test_setup_commands_are_the_two_ci_runs():
    blocks = re.findall(r"```sh\n(.*?)\n```", README, flags=re.S)
    assert blocks[:2] == ["pip install . && relayout demo", "pip install '.[test]' && python -m pytest -q"]
    ci = (REPO / ".ci" / "run").read_text()
    assert "pip install -q '.[test]' && python -m pytest -q" in ci


def test_every_command_has_a_line_in_the_commands_table():
    table = README[README.index("## Commands"):]
    table = table[:table.index("\n\n", table.index("| command |"))]
    listed = set(re.findall(r"^\| `([a-z-]+)", table, flags=re.M))
    listed |= set(re.findall(r", `([a-z-]+)", table))
    missing = _commands() - listed
    assert not missing, f"commands without a line in the README: {sorted(missing)}"


def test_reference_covers_every_command():
    reference = (REPO / "docs" / "REFERENCE.md").read_text()
    missing = {c for c in _commands() if f"`{c}" not in reference}
    assert not missing, f"commands missing from docs/REFERENCE.md: {sorted(missing)}"
