"""The committed lock (requirements/lock.txt, made by scripts/lock.sh) is what scripts/setup.sh
installs: it satisfies pyproject.toml's ranges, it is complete (every dependency of every locked
package is locked too), every pin carries a hash, and this environment was built from it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers.project_files import LOCK, NO_DEPS, ROOT, lock_inputs, read_pins, requirements

SETUP_EXTRAS = ("serve", "bench", "dev")  # what setup.sh installs (the dev extra names the others)


def _applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate({"extra": ""})


def test_lock_satisfies_every_declared_range_and_lock_input() -> None:
    pins = read_pins(LOCK)
    for req in [*requirements(*SETUP_EXTRAS), *lock_inputs()]:
        if not _applies(req):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} (pyproject.toml / lock.in) is not in {LOCK.name}: run scripts/lock.sh"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} violates {req}"


def test_every_pin_carries_a_hash() -> None:
    for path in (LOCK, NO_DEPS):
        blocks = path.read_text().split("\n")
        for i, line in enumerate(blocks):
            if "==" in line and not line.startswith((" ", "#")):
                assert line.rstrip().endswith("\\") and "--hash=sha256:" in blocks[i + 1], (path.name, line)


def test_setup_installs_the_lock_with_hashes() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "--require-hashes -r requirements/lock.txt" in setup
    assert "--no-deps --require-hashes -r requirements/no-deps.txt" in setup
    assert "--no-deps -e ." in setup


def _installed_version(name: str) -> str | None:
    try:
        return distribution(name).version
    except PackageNotFoundError:
        return None


def _built_from_lock() -> bool:
    pins = read_pins(LOCK)
    return _installed_version("torch") == pins["torch"]


@pytest.mark.skipif(
    not _built_from_lock(),
    reason="this environment was not built by scripts/setup.sh "
    "(its torch is not the locked CPU build): CUDA users install open ranges",
)
def test_environment_equals_the_lock_and_the_lock_is_closed() -> None:
    """Every locked package is installed at its pin, and each one's own requirements are locked."""
    pins = read_pins(LOCK)
    no_deps = read_pins(NO_DEPS)
    for name, version in {**pins, **no_deps}.items():
        assert _installed_version(name) == version, f"{name}: installed {_installed_version(name)}, locked {version}"
    for name in pins:
        for text in distribution(name).requires or []:
            req = Requirement(text)
            if _applies(req):
                dep = canonicalize_name(req.name)
                assert dep in pins, f"{name} needs {req}, which {LOCK.name} does not hold"
                assert req.specifier.contains(pins[dep], prereleases=True), f"{name} needs {req}, locked {pins[dep]}"
    # The --no-deps client: its dependencies are locked (its huggingface-hub<1 pin is knowingly overridden).
    for name in no_deps:
        for text in distribution(name).requires or []:
            req = Requirement(text)
            if _applies(req):
                assert canonicalize_name(req.name) in pins, f"{name} needs {req.name}, not in {LOCK.name}"
