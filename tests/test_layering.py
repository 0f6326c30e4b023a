"""Dependencies point one way: relayout -> replay -> containers, never back."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = {"containers": {"replay", "relayout"}, "replay": {"relayout"}}


def imported_packages(path: Path) -> set[str]:
    """Top-level packages a module imports (absolute imports; relative ones stay in the package)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_no_package_imports_a_package_above_it():
    bad = []
    for package, above in FORBIDDEN.items():
        for path in sorted((REPO / package).glob("*.py")):
            for name in sorted(imported_packages(path) & above):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert bad == []


def test_the_check_sees_a_violation(tmp_path):
    """The checker itself can fail: a module importing upwards, at any depth, is caught."""
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from relayout.plan import make_plan\n    import replay.gate\n")
    assert imported_packages(p) == {"relayout", "replay"}
