"""What the packaging tests read from the checkout: pyproject.toml's dependency lists and the lock.

Names are compared in PEP 503 normal form (lower case, runs of ``-_.`` as one ``-``).
"""

from __future__ import annotations

import re
import sys
from functools import cache
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SELF = "tgi-paged-backend"
LOCK = ROOT / "requirements" / "lock.txt"
LOCK_INPUTS = ROOT / "requirements" / "lock.in"
NO_DEPS = ROOT / "requirements" / "no-deps.txt"


@cache
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirements(*extras: str) -> list[Requirement]:
    """The core dependencies plus those of ``extras``, self-references (``pkg[extra]``) expanded."""
    project = pyproject()["project"]
    out = [Requirement(r) for r in project["dependencies"]]
    pending, done = list(extras), set()
    while pending:
        extra = pending.pop()
        if extra in done:
            continue
        done.add(extra)
        for text in project["optional-dependencies"][extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == SELF:
                pending.extend(req.extras)
            else:
                out.append(req)
    return out


def declared(*extras: str) -> set[str]:
    return {canonicalize_name(r.name) for r in requirements(*extras)}


def read_pins(path: Path) -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line of a pip requirements file."""
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if match:
            pins[canonicalize_name(match[1])] = match[2]
    return pins


def lock_inputs() -> list[Requirement]:
    lines = [line.split("#")[0].strip() for line in LOCK_INPUTS.read_text().splitlines()]
    return [Requirement(line) for line in lines if line]
