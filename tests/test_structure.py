"""The house rules, checked on the tree: small modules with one job, thin scripts, an acyclic import graph."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.checkpoints import ROOT

PACKAGES = ("moe", "models")


def python_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Modules of our packages that `path` imports at module level (imports inside functions are deferred
    on purpose and cannot form a cycle at import time). `from pkg import sub` depends on `pkg.sub` only."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            found.update(subs or {node.module})
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
    return found


def test_no_import_cycles():
    modules = {module_name(p): p for p in python_files(*PACKAGES)}
    graph = {m: {i for i in imports_of(p, set(modules)) if i in modules and i != m} for m, p in modules.items()}
    state: dict[str, str] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph[m]):
            assert state.get(n) != "open", "import cycle: " + " -> ".join([*path, m, n])
            if n not in state:
                visit(n, [*path, m])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_few_modules_directly_in_the_package():
    top = [p.name for p in (ROOT / "moe").glob("*.py")]
    assert len(top) <= 10, top


def test_files_and_functions_are_short():
    too_long = [f"{p.relative_to(ROOT)}: {n} lines" for p in python_files(*PACKAGES, "scripts", "tests")
                if (n := len(p.read_text().splitlines())) > 350]
    assert not too_long
    long_functions = []
    for p in python_files(*PACKAGES, "scripts"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long_functions.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long_functions


def test_scripts_are_thin_and_leave_sys_path_alone():
    for p in python_files("scripts"):
        text = p.read_text()
        assert len(text.splitlines()) <= 80, p.name
        assert "sys.path" not in text, p.name
    for p in python_files(*PACKAGES, "tests"):
        assert p.name == "test_structure.py" or "sys.path.insert" not in p.read_text(), p
