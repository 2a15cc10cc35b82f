"""The package's rooms: no two files share a name, a small core at the root, and imports that only go down."""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "ddp_lib"
MAX_ROOT_MODULES = 10
PLUMBING = {"__init__.py", "__main__.py"}  # every package has them: not names a reader confuses


@functools.cache
def package_files() -> tuple[Path, ...]:
    return tuple(sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def imports_of(path: Path) -> frozenset[str]:
    """The ddp_lib modules `path` imports, anywhere in it (a function's deferred import included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ddp_lib"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddp_lib") and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from ddp_lib import comm`
    known = {module_name(p) for p in package_files()}
    return frozenset(name for name in found if name in known)


def duplicate_names(paths: list[Path]) -> dict[str, list[str]]:
    by_name = defaultdict(list)
    for p in paths:
        if p.name not in PLUMBING:
            by_name[p.name].append(str(p.relative_to(ROOT)))
    return {name: where for name, where in by_name.items() if len(where) > 1}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle's path found by a depth-first walk (empty: the graph is acyclic)."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def group_of(module: str) -> str:
    """`ddp_lib.check.engine` -> `ddp_lib.check`; a root module is its own group."""
    parts = module.split(".")
    return ".".join(parts[:2])


@functools.cache
def group_graph() -> dict[str, set[str]]:
    graph = defaultdict(set)
    for p in package_files():
        me = group_of(module_name(p))
        if module_name(p) == "ddp_lib":
            continue  # the package's face hands names on
        graph[me].update(g for g in map(group_of, imports_of(p)) if g not in (me, "ddp_lib"))
    return graph


def test_no_two_package_files_share_a_name():
    assert not duplicate_names(package_files())


def test_the_root_holds_at_most_10_modules():
    root = [p.name for p in ROOT.glob("*.py") if p.name not in PLUMBING]
    assert len(root) <= MAX_ROOT_MODULES, sorted(root)


def test_the_root_core_imports_no_subpackage():
    """The core at the root (devices, mesh, comm, launch, ...) is the ground: it imports no package above it."""
    subpackages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    up = {p.name: sorted(m for m in imports_of(p) if m.count(".") and m.split(".")[1] in subpackages)
          for p in ROOT.glob("*.py") if p.name not in PLUMBING}
    assert not {k: v for k, v in up.items() if v}, up


def test_no_import_cycle_between_the_packages_rooms():
    """Root modules and subpackages import each other in no loop (a loop means one of them imports upward)."""
    assert not cycles(group_graph()), cycles(group_graph())


def test_the_checks_see_a_shared_name_and_a_cycle(tmp_path):
    assert duplicate_names([Path(ROOT / "a" / "x.py"), Path(ROOT / "b" / "x.py")]) == {"x.py": ["a/x.py", "b/x.py"]}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert not cycles({"a": {"b"}, "b": {"c"}})


@pytest.mark.parametrize("group", ["ddp_lib.notebook", "ddp_lib.fsdp", "ddp_lib.ddp", "ddp_lib.contract"])
def test_the_runtime_imports_no_lesson_tooling(group):
    """The engines, FSDP and the magics never import the simulator, the checkers, the benchmarks or the course."""
    assert not group_graph()[group] & {"ddp_lib.gpusim", "ddp_lib.check", "ddp_lib.bench", "ddp_lib.course"}


MAX_CHECK_FUNCTION_LINES = 50


def long_functions(paths: tuple[Path, ...], limit: int) -> dict[str, int]:
    """`file:line name` -> length of every function (methods and nested ones too) longer than `limit` lines."""
    found = {}
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found[f"{p.name}:{node.lineno} {node.name}"] = length
    return found


def test_no_checker_function_is_over_50_lines():
    """The checkers read as a table of properties and one short function per property's evidence."""
    checkers = tuple(p for p in package_files() if p.relative_to(ROOT).parts[0] == "check")
    assert checkers
    assert not long_functions(checkers, MAX_CHECK_FUNCTION_LINES), long_functions(checkers, MAX_CHECK_FUNCTION_LINES)


def test_the_length_check_sees_a_long_method(tmp_path):
    src = tmp_path / "x.py"
    body = "\n".join(f"        a{i} = {i}" for i in range(50))
    src.write_text(f"class C:\n    def short(self):\n        pass\n\n    def long(self):\n{body}\n")
    found = long_functions((src,), MAX_CHECK_FUNCTION_LINES)
    assert list(found.values()) == [51]
