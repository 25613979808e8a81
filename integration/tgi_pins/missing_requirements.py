"""Which runtime requirements of an installed distribution the current environment lacks.

Used by ``integration/Dockerfile`` after ``pip install --no-deps``: it prints one requirement per line
and installs only those, so nothing the TGI image already has is touched.

    python missing_requirements.py tgi-paged-backend              # absent packages
    python missing_requirements.py tgi-paged-backend --conflicts  # installed, but outside our range

Extras-only requirements are ignored; environment markers are evaluated here. Needs ``packaging``.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import Version


def classify(dist: str) -> tuple[list[str], list[str]]:
    """``(missing, conflicts)`` for ``dist``'s unconditional runtime requirements."""
    missing, conflicts = [], []
    for raw in metadata.requires(dist) or []:
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            installed = Version(metadata.version(req.name))
        except metadata.PackageNotFoundError:
            missing.append(str(req))
            continue
        if req.specifier and not req.specifier.contains(installed, prereleases=True):
            conflicts.append(f"{req} (installed {installed})")
    return missing, conflicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dist")
    parser.add_argument("--conflicts", action="store_true", help="list installed-but-out-of-range instead")
    args = parser.parse_args(argv)
    missing, conflicts = classify(args.dist)
    for line in conflicts if args.conflicts else missing:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
