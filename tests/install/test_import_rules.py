"""The package's layering as tests: kernels only through ``tgi_paged_kernels``' public face, no kernels in the
engine, no private name used across packages, no import cycle, and the size limits that keep rooms small.

Imports are read from the source (every ``import`` statement, at module level or inside a function, except
under ``if TYPE_CHECKING:``), so a lazy import counts like any other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tests.helpers.project_files import ROOT

PACKAGE = "tgi_paged_backend"
KERNELS = "tgi_paged_kernels"
MAX_PRODUCT_FILE_LINES = 450
MAX_FILES_PER_RUNNER_FOLDER = 8
GENERATED = ("tgi_paged_backend/server/pb/",)


@dataclass(frozen=True, slots=True)
class Import:
    module: str
    """The importing module (dotted)."""
    target: str
    """The module imported from (dotted, absolute)."""
    names: tuple[str, ...]
    """Names imported from ``target`` (``()`` for ``import target``)."""
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _sources() -> dict[str, tuple[Path, ast.Module]]:
    found = {}
    for top in (PACKAGE, KERNELS):
        for path in sorted((ROOT / top).rglob("*.py")):
            if not any(str(path.relative_to(ROOT)).startswith(g) for g in GENERATED):
                found[_module_name(path)] = (path, ast.parse(path.read_text(), str(path)))
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_runtime(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node`` except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            yield from (n for stmt in child.orelse for n in [stmt, *_walk_runtime(stmt)])
            continue
        yield child
        yield from _walk_runtime(child)


def _imports(module: str) -> list[Import]:
    path, tree = _sources()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in _walk_runtime(tree):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append(Import(module, target, tuple(a.name for a in node.names), node.lineno))
    return found


def _ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _package_of(module: str) -> str:
    """The first level under the package (``engine``, ``runner``, ``cli``, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _product_modules() -> list[str]:
    return [m for m in _sources() if _ours(m)]


def test_the_package_imports_kernels_only_through_their_public_face() -> None:
    import tgi_paged_kernels

    public = set(tgi_paged_kernels.__all__)
    bad = []
    for module in _product_modules():
        for imp in _imports(module):
            if imp.target.startswith(KERNELS + "."):
                bad.append(f"{module}:{imp.line} imports {imp.target}")
            elif imp.target == KERNELS and not set(imp.names) <= public:
                bad.append(f"{module}:{imp.line} imports {sorted(set(imp.names) - public)} (not in __all__)")
    assert not bad, "\n".join(bad)


def test_the_engine_does_not_import_kernels() -> None:
    bad = [
        f"{module}:{imp.line} imports {imp.target}"
        for module in _product_modules()
        if _package_of(module) == "engine"
        for imp in _imports(module)
        if imp.target == KERNELS or imp.target.startswith(KERNELS + ".")
    ]
    assert not bad, "\n".join(bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_name_is_used_across_packages() -> None:
    sources = _sources()
    bad = []
    for module in _product_modules():
        home = _package_of(module)
        foreign_modules: dict[str, str] = {}  # local name -> module of another package
        for imp in _imports(module):
            if not _ours(imp.target) or _package_of(imp.target) == home:
                continue
            for name in imp.names:
                if _private(name):
                    bad.append(f"{module}:{imp.line} imports {imp.target}.{name}")
                if f"{imp.target}.{name}" in sources:
                    foreign_modules[name] = f"{imp.target}.{name}"
        tree = sources[module][1]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in foreign_modules:
                    bad.append(f"{module}:{node.lineno} uses {foreign_modules[owner.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


def _edges() -> dict[str, set[str]]:
    sources = _sources()
    graph: dict[str, set[str]] = {m: set() for m in _product_modules()}
    for module in graph:
        for imp in _imports(module):
            if not _ours(imp.target):
                continue
            submodules = {f"{imp.target}.{n}" for n in imp.names} & set(sources)
            targets = submodules or {imp.target}
            if imp.names and len(submodules) < len(imp.names):
                targets.add(imp.target)  # names defined in the package's __init__ itself
            graph[module] |= {t for t in targets if t in graph and t != module}
    return graph


def test_no_import_cycle_in_the_product() -> None:
    graph = _edges()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [node, nxt]) if nxt in stack else nxt)
            elif nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(cycles)


def test_product_files_stay_small() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for module, (path, _) in _sources().items()
        if _ours(module)
    }
    big = {path: n for path, n in sizes.items() if n > MAX_PRODUCT_FILE_LINES}
    assert not big, f"over {MAX_PRODUCT_FILE_LINES} lines: {big}"


def test_runner_folders_hold_few_files() -> None:
    for folder in [ROOT / PACKAGE / "runner", *(p for p in (ROOT / PACKAGE / "runner").iterdir() if p.is_dir())]:
        if folder.name == "__pycache__":
            continue
        files = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(files) <= MAX_FILES_PER_RUNNER_FOLDER, (folder.name, sorted(files))


def test_the_planner_imports_no_benchmark() -> None:
    """``tgi-paged-backend plan`` ships; the benchmarks' shared code (``bench/``) is not part of it."""
    bad = [
        f"{module}:{imp.line} imports {imp.target}"
        for module in _product_modules()
        if _package_of(module) == "planning"
        for imp in _imports(module)
        if _package_of(imp.target) == "bench" and _ours(imp.target)
    ]
    assert not bad, "\n".join(bad)
