"""Every global name a module uses is defined in it, imported or built in: a name left behind when
code moves between modules fails here, not in the one command that reaches it."""

import builtins
import symtable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__builtins__", "__path__", "__package__"}


def undefined_globals(source: str, name: str) -> set[str]:
    """Names ``source`` reads as globals (at module level or from a function) that nothing binds."""
    top = symtable.symtable(source, name, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    bound |= set(dir(builtins)) | MODULE_NAMES
    missing = set()

    def walk(table):
        for s in table.get_symbols():
            global_use = s.is_global() or (table.get_type() == "module" and s.is_referenced())
            if global_use and s.get_name() not in bound:
                missing.add(s.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return missing


def test_every_module_defines_or_imports_the_globals_it_uses():
    bad = {}
    for package in ("containers", "replay", "relayout", "benchmarks"):
        for path in sorted((REPO / package).rglob("*.py")):
            missing = undefined_globals(path.read_text(), str(path))
            if missing:
                bad[str(path.relative_to(REPO))] = sorted(missing)
    assert bad == {}


def test_the_check_sees_a_name_left_behind():
    src = "from os import path\n\ndef f():\n    return path.join(tensor_specs(), 'x')\n"
    assert undefined_globals(src, "m.py") == {"tensor_specs"}
