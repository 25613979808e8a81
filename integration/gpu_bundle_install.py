"""Install the GPU bundle's wheels offline, only those this interpreter lacks or holds too old.

The device image already has torch, triton and transformers and many of their neighbours
(grpcio, protobuf, tokenizers, ...). Shadowing a present package with the bundle's newer pin
could break transformers' import-time version checks, so a bundled wheel is installed only when
its project is missing here, or when the installed version violates a requirement of a wheel
being installed (this package's own ``Requires-Dist`` first), repeated to a fixpoint; present
packages that satisfy every requirement are left alone. Everything
goes into ``--target`` (``pip install --no-index --no-deps --target``), which the caller puts on
``PYTHONPATH`` and whose ``bin/`` (``text-generation-server``) goes on ``PATH``.

    python integration/gpu_bundle_install.py --wheels out/gpu_bundle/wheels --target /tmp/gpu_site

Standard library plus ``packaging`` (a transformers dependency) only: it runs before anything else.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

OWN_PROJECT = "tgi-paged-backend"


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's ``Requires-Dist`` that apply here (markers evaluated without extras)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if re.match(r"[^/]+\.dist-info/METADATA$", n))
        text = archive.read(name).decode("utf-8", "replace")
    env = {**default_environment(), "extra": ""}
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or req.marker.evaluate(env):
            out.append(req)
    return out


def installed_version(project: str, target: Path) -> Version | None:
    """The version visible to this interpreter or already in ``target``, ``None`` if absent."""
    for dist in metadata.distributions(path=[str(target), *sys.path]):
        if canonicalize_name(dist.metadata["Name"] or "") == project:
            return Version(dist.version)
    return None


def plan(wheels: dict[str, tuple[Version, Path]], target: Path) -> tuple[list[Path], list[str]]:
    """Wheels to install and one line per decision.

    Roots: this package, and every bundled project missing here (gguf, accelerate: what the check
    itself needs). Then, to a fixpoint, each requirement of a chosen wheel that the installed
    version does not satisfy pulls in the bundled wheel; one the bundle lacks is reported.
    """
    chosen: dict[str, Path] = {}
    notes: list[str] = []
    queue = [OWN_PROJECT] + [p for p in wheels if p != OWN_PROJECT and installed_version(p, target) is None]
    queued, reported = set(queue), set()
    for project in queue[1:]:
        notes.append(f"install {project}=={wheels[project][0]}: missing")
    while queue:
        project = queue.pop(0)
        chosen[project] = wheels[project][1]
        for req in wheel_requirements(wheels[project][1]):
            dep = canonicalize_name(req.name)
            if dep in queued or dep in reported:
                continue
            have = installed_version(dep, target)
            if have is not None and req.specifier.contains(have, prereleases=True):
                continue
            if dep not in wheels:
                reported.add(dep)
                state = "missing" if have is None else f"{have} installed"
                notes.append(f"NOT IN BUNDLE: {req} (needed by {project}; {state})")
                continue
            notes.append(f"install {dep}=={wheels[dep][0]}: {have} does not satisfy {req} (needed by {project})")
            queue.append(dep)
            queued.add(dep)
    return list(chosen.values()), notes


def runs_here(interpreter: str, abi: str) -> bool:
    """Whether a wheel tag's interpreter/abi pair loads in this CPython (platform: the bundle's, x86-64 Linux)."""
    if interpreter.startswith("py"):
        return True
    match = re.fullmatch(r"cp3(\d+)", interpreter)
    if match is None:
        return False
    minor = int(match.group(1))
    return minor == sys.version_info.minor or (abi == "abi3" and minor <= sys.version_info.minor)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, required=True)
    parser.add_argument("--target", type=Path, required=True)
    args = parser.parse_args(argv)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels: dict[str, tuple[Version, Path]] = {}
    for wheel in sorted(args.wheels.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(wheel.name)
        if not any(runs_here(t.interpreter, t.abi) for t in tags):
            continue  # built for another Python
        wheels[canonicalize_name(name)] = (version, wheel)
    if OWN_PROJECT not in wheels:
        print(f"no {OWN_PROJECT} wheel for {tag} in {args.wheels}: run scripts/build_gpu_bundle.sh", file=sys.stderr)
        return 1
    chosen, notes = plan(wheels, args.target)
    for note in notes:
        print(f"  {note}")
    missing = [n for n in notes if n.startswith("NOT IN BUNDLE")]
    args.target.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--disable-pip-version-check",
        "--upgrade",
        "--target",
        str(args.target),
        *map(str, chosen),
    ]
    print(f"installing {len(chosen)} wheels into {args.target}: {', '.join(p.name.split('-')[0] for p in chosen)}")
    result = subprocess.run(cmd)
    if result.returncode != 0:
        print(f"pip failed (exit {result.returncode}): {' '.join(cmd)}", file=sys.stderr)
        return result.returncode
    if missing:
        print(
            f"{len(missing)} requirement(s) neither installed nor bundled; the check may fail on import",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
