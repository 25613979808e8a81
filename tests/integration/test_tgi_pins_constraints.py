"""The TGI 3.3 image's pins (integration/tgi_pins/) are admitted by pyproject's dependency ranges."""

from __future__ import annotations

import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PINS = ROOT / "integration" / "tgi_pins"


def pins(name: str) -> dict[str, Requirement]:
    out = {}
    for line in (PINS / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            assert len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==", line
            out[canonicalize_name(req.name)] = req
    return out


def runtime_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    return {canonicalize_name(r.name): r for r in reqs}


def rejected(pin_file: str) -> list[str]:
    ranges = runtime_requirements()
    out = []
    for name, pin in pins(pin_file).items():
        version = next(iter(pin.specifier)).version
        if name in ranges and not ranges[name].specifier.contains(version, prereleases=True):
            out.append(f"{name}=={version} vs {ranges[name]}")
    return out


def test_pins_file_is_well_formed_and_covers_the_core_deps():
    pinned = pins("constraints.txt")
    for name in ("transformers", "protobuf", "grpcio", "triton"):
        assert name in pinned
    assert "torch" not in pinned  # 2.7.0 is not installable here; check.sh uses 2.13.0


def test_pyproject_admits_the_tgi_image_pins():
    assert rejected("constraints.txt") == []


def test_pyproject_admits_torch_2_7():
    torch = runtime_requirements()["torch"]
    assert torch.specifier.contains("2.7.0")


def test_pyproject_admits_the_uv_lock_pins():
    assert rejected("constraints-uvlock.txt") == []
