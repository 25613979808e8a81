"""Import rules of ``planning/`` (the shipped ``plan``) and ``bench/`` (the benchmarks' shared code).

- No private name of another package: a name starting with ``_`` imported from another
  ``tgi_paged_backend`` package, or read off a module or class imported from one (``module._helper``,
  ``SomeClass._method``), must first become public in its home module.
- ``planning/`` does not import ``bench/``: the benchmarks build on the planner, not the other way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.project_files import ROOT

TOP = "tgi_paged_backend"
CHECKED = ("planning", "bench")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _home_package(module: str) -> str:
    """The package that holds ``module`` (a package is its own home)."""
    path = ROOT.joinpath(*module.split("."))
    return module if path.is_dir() else module.rpartition(".")[0]


def private_uses(source: str, package: str) -> list[str]:
    """``line: what`` for every private name ``source`` (a module of ``package``) takes from another
    ``tgi_paged_backend`` package. Static: names read off an imported module or class are seen, those read
    off an instance (``runner._x``) are not."""
    found: list[str] = []
    foreign: dict[str, str] = {}  # local name -> the dotted name it was imported as
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(TOP):
            module = node.module or ""
            if _home_package(module) == package:
                continue
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{node.lineno}: from {module} import {alias.name}")
                foreign[alias.asname or alias.name] = f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(TOP) and _home_package(alias.name) != package:
                    # `import a.b.c as m` binds m to a.b.c; `import a.b.c` binds a (the chain follows).
                    foreign[alias.asname or TOP] = alias.name if alias.asname else TOP
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        base: ast.expr = node.value
        parts = []
        while isinstance(base, ast.Attribute):
            parts.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in foreign:
            dotted = ".".join([foreign[base.id], *reversed(parts)])
            if not dotted.startswith(package + "."):
                found.append(f"{node.lineno}: {dotted}.{node.attr}")
    return found


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / TOP / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", CHECKED)
def test_no_private_name_of_another_package(folder: str) -> None:
    bad = []
    for path in _modules(folder):
        package = ".".join(path.parent.relative_to(ROOT).parts)
        bad += [f"{path.relative_to(ROOT)}:{use}" for use in private_uses(path.read_text(), package)]
    assert not bad, "make these public in their home module:\n" + "\n".join(bad)


def test_planning_does_not_import_the_benchmarks() -> None:
    bad = []
    for path in _modules("planning"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.startswith(f"{TOP}.bench")]
    assert not bad, bad


@pytest.mark.parametrize(
    "source",
    [
        "from tgi_paged_backend.runner.memory_budget import _helper\n",
        "from tgi_paged_backend.runner.model_runner import ModelRunner\nModelRunner._estimate_prefill_bytes(1)\n",
        "from tgi_paged_backend.runner import memory_budget\nmemory_budget._helper()\n",
        "import tgi_paged_backend.runner.memory_budget as mb\nmb._helper()\n",
        "import tgi_paged_backend.runner.memory_budget\ntgi_paged_backend.runner.memory_budget._helper()\n",
    ],
)
def test_the_rule_sees_each_kind_of_private_use(source: str) -> None:
    assert private_uses(source, f"{TOP}.planning"), source


def test_the_rule_allows_private_names_within_the_package_and_public_ones_across() -> None:
    source = (
        "from tgi_paged_backend.planning.sim_allocators import _Allocator\n"
        "from tgi_paged_backend.planning import sim_allocators\n"
        "sim_allocators._prompt_ids(1)\n"
        "from tgi_paged_backend.runner.memory_budget import estimate_prefill_bytes\n"
        "from tgi_paged_backend.memory import KVCacheManager\n"
        "def f(kv: KVCacheManager):\n"
        "    return kv.stats(), KVCacheManager.__name__\n"
    )
    assert private_uses(source, f"{TOP}.planning") == []
