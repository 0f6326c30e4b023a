"""Every third-party module the package imports is a declared dependency (a fresh machine gets
only what pyproject.toml asks for: the test environment may hold more, so importing is no proof)."""

import ast
import sys
import tomllib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("relayout", "replay", "containers", "manifests")


def _imported_top_levels() -> dict[str, str]:
    """Top-level module -> one file importing it, over the installed packages' sources."""
    found = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for n in names:
                    found.setdefault(n.split(".")[0], str(path.relative_to(REPO)))
    return found


def _requirement_names(req: str) -> set[str]:
    """The distribution a requirement names, and those its extras stand for (``dask[distributed]``)."""
    extras = req.split("[", 1)[1].split("]", 1)[0].split(",") if "[" in req else []
    for stop in "[<>=!~; ":
        req = req.split(stop)[0]
    return {n.strip().lower().replace("_", "-") for n in [req, *extras] if n.strip()}


def test_every_third_party_import_is_declared():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = set().union(*(_requirement_names(r) for r in project["dependencies"]))
    optional = set().union(*(_requirement_names(r) for r in project.get("optional-dependencies", {}).get("plots", [])))
    dists = metadata.packages_distributions()
    missing = []
    for module, where in sorted(_imported_top_levels().items()):
        if module in sys.stdlib_module_names or module in PACKAGES or module == "__future__":
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & (declared | optional):
            missing.append(f"{module} (imported by {where}; distribution {', '.join(sorted(names))})")
    assert not missing, "imported but not declared in pyproject.toml: " + "; ".join(missing)
