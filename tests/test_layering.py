"""The house's floors and rooms: dependencies point one way and no two modules import each other.

Floors: ``relayout -> replay -> containers``, never back. Inside ``replay`` the rooms form a
ladder, each importing only the rooms below it::

    execution  <  model  <  formats  <  evaluation  <  physical  <  colibri  <  control

Every module at any depth is checked, imports inside functions included, and the module graph
(every import, at any depth) has no cycle. A module's own enclosing packages are not counted as
its imports: Python imports them before the module whatever it says.
"""

import ast
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("containers", "replay", "relayout")
FLOORS = {"containers": 0, "replay": 1, "relayout": 2}
ROOMS = {"execution": 0, "model": 1, "formats": 2, "evaluation": 3, "physical": 4, "colibri": 5, "control": 6}


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, known: set[str], root: Path = REPO) -> set[str]:
    """The project modules ``path`` imports (absolute or relative, at any depth of the file)."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != me and not me.startswith(name + "."):
                out.add(name)       # a module's own packages are imported before it in any case
    return out


def import_graph(root: Path = REPO) -> nx.DiGraph:
    files = {module_name(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    g = nx.DiGraph()
    g.add_nodes_from(files)
    for name, path in files.items():
        g.add_edges_from((name, dep) for dep in imported_modules(path, set(files), root))
    return g


def _floor(name: str) -> int:
    return FLOORS[name.split(".")[0]]


def _room(name: str) -> int | None:
    parts = name.split(".")
    if parts[0] != "replay" or len(parts) < 2:
        return None
    return ROOMS.get(parts[1])


def layering_problems(g: nx.DiGraph) -> list[str]:
    bad = []
    for a, b in g.edges:
        if _floor(b) > _floor(a):
            bad.append(f"{a} imports {b} (a floor above)")
        ra, rb = _room(a), _room(b)
        if ra is not None and rb is not None and rb > ra:
            bad.append(f"{a} imports {b} (a room above)")
        if a.startswith("replay.") and b == "replay" and _room(a) is not None:
            bad.append(f"{a} imports the replay package itself")
    for cycle in nx.simple_cycles(g):
        bad.append("import cycle: " + " -> ".join(cycle + cycle[:1]))
        if len(bad) > 40:
            break
    return sorted(bad)


def test_no_module_imports_a_floor_or_room_above_it_and_there_is_no_cycle():
    assert layering_problems(import_graph()) == []


def test_every_room_is_known():
    rooms = {p.name for p in (REPO / "replay").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(ROOMS) - {"execution"}


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


def test_the_check_sees_an_upward_import_at_any_depth(tmp_path):
    root = _tree(tmp_path, {
        "containers/deep/m.py": "def f():\n    from relayout.planning.plan import make_plan\n",
        "relayout/planning/plan.py": "def make_plan(): pass\n",
        "replay/model/__init__.py": "",
        "replay/model/loop.py": "from ..evaluation import gate\n",
        "replay/evaluation/__init__.py": "",
        "replay/evaluation/gate.py": "",
    })
    problems = layering_problems(import_graph(root))
    assert "containers.deep.m imports relayout.planning.plan (a floor above)" in problems
    assert "replay.model.loop imports replay.evaluation.gate (a room above)" in problems


def test_the_check_sees_a_cycle(tmp_path):
    root = _tree(tmp_path, {
        "relayout/workflows/demo.py": "from relayout.workflows import validate\n",
        "relayout/workflows/validate.py": "def f():\n    from .demo import run\n",
    })
    problems = layering_problems(import_graph(root))
    assert any(p.startswith("import cycle:") and "relayout.workflows.demo" in p for p in problems)
