"""Every third-party module the repository imports comes from a declared dependency.

Each folder may use what its extra brings: the shipped package only the core dependencies, the
router replay / HTTP stand-in / demo (``integration/``) also ``serve``, the examples and tests also
``dev`` (the tests also the official client, ``tgi-client``). An import inside ``try:`` whose
handler catches ``ImportError`` is optional (the code says what to do without it) and is not
counted. Some dependencies are never imported by name: they are listed in ``IMPLICIT`` with the
source text that needs them (transformers refuses ``gguf_file=`` without ``gguf`` and
``accelerate``: the break that made this test).
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from importlib.metadata import distribution, packages_distributions
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.helpers.project_files import ROOT, declared

SCOPES = {
    "tgi_paged_backend": (),
    "tgi_paged_kernels": (),
    "integration": ("serve",),
    "examples": ("serve", "dev"),
    "tests": ("serve", "dev", "tgi-client"),
}
# Modules that files under a folder import in another environment than this one, and why.
OTHER_ENVIRONMENTS = {
    "integration/peers/": ({"vllm"}, "runs with the vLLM peer venv's python (scripts/build_peer_venvs.sh)")
}
# source text -> distributions it needs at run time without importing them by name.
IMPLICIT = {"gguf_file=": ("gguf", "accelerate")}
# Local module names: every .py file and folder of the checkout (tests import siblings and folders).
LOCAL = {
    p.stem
    for p in ROOT.rglob("*")
    if not any(part.startswith(".") for part in p.relative_to(ROOT).parts) and (p.is_dir() or p.suffix == ".py")
}


def _optional_nodes(tree: ast.AST) -> set[int]:
    """ids of import nodes inside a ``try`` that handles ImportError / ModuleNotFoundError."""
    optional = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        caught = set()
        for handler in node.handlers:
            types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            caught |= {t.id for t in types if isinstance(t, ast.Name)}
        if caught & {"ImportError", "ModuleNotFoundError"}:
            optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return optional


def third_party_imports(path: Path) -> set[str]:
    """Dotted module names imported by ``path`` that are neither stdlib nor local, nor optional."""
    tree = ast.parse(path.read_text(), filename=str(path))
    optional = _optional_nodes(tree)
    names = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {n for n in names if n.split(".")[0] not in sys.stdlib_module_names | LOCAL}


@cache
def _providers() -> dict[str, list[str]]:
    return packages_distributions()


def providing_distributions(module: str) -> set[str]:
    """The installed distributions that provide ``module`` (namespace packages such as
    ``opentelemetry`` narrowed by the second component)."""
    top, _, rest = module.partition(".")
    candidates = {canonicalize_name(d) for d in _providers().get(top, [])}
    if not candidates:  # not installed here (say `tomli` on Python >= 3.11): the name is the project's
        return {canonicalize_name(top)}
    if len(candidates) > 1 and rest:
        sub = f"{top}/{rest.split('.')[0]}"
        narrowed = {
            d for d in candidates if any(str(f).startswith((sub + "/", sub + ".")) for f in distribution(d).files or [])
        }
        candidates = narrowed or candidates
    return candidates


def _files(scope: str) -> list[Path]:
    return sorted((ROOT / scope).rglob("*.py"))


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_every_third_party_import_is_declared(scope: str) -> None:
    allowed = declared(*SCOPES[scope])
    undeclared = {}
    for path in _files(scope):
        elsewhere = set().union(
            *(
                mods
                for folder, (mods, _) in OTHER_ENVIRONMENTS.items()
                if str(path.relative_to(ROOT)).startswith(folder)
            )
        )
        for module in third_party_imports(path):
            if module.split(".")[0] in elsewhere:
                continue
            providers = providing_distributions(module)
            if not providers & allowed:
                undeclared.setdefault(module, []).append(str(path.relative_to(ROOT)))
    assert not undeclared, f"{scope}/ imports modules no declared dependency provides: {undeclared}"


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_implicit_run_time_dependencies_are_declared(scope: str) -> None:
    allowed = declared(*SCOPES[scope])
    for path in _files(scope):
        text = path.read_text()
        for trigger, needs in IMPLICIT.items():
            if trigger in text:
                missing = set(needs) - allowed
                assert not missing, f"{path.relative_to(ROOT)} uses {trigger!r}, which needs {missing}"


def test_the_walk_sees_what_it_must() -> None:
    """The walker itself: optional imports are skipped, others found, namespaces narrowed."""
    source = ROOT / "tgi_paged_backend" / "runner" / "model_runner.py"
    assert "psutil" not in third_party_imports(source)  # inside try/except ImportError
    assert "torch" in third_party_imports(source)
    assert providing_distributions("opentelemetry.sdk.metrics") == {"opentelemetry-sdk"}
    assert "accelerate" in declared("serve") and "accelerate" not in declared()
