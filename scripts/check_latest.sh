#!/usr/bin/env bash
# Drift check, report-only: does the project still work with the LATEST releases that
# pyproject.toml's open ranges admit (what `pip install tgi-paged-backend` gets a user today),
# rather than the committed lock? Builds a throwaway venv (torch stays the local CPU build
# torch==2.13.0: an unpinned torch is a multi-GB CUDA wheel), installs the package non-editable
# with its dev extra, converts SmolLM2 afresh, and runs a quick but real subset: packaging checks,
# kernels, memory manager, one shard end to end through the router replay, SmolLM2 against HF.
#
# Prints what differs from requirements/lock.txt and ends with one line:
#   check_latest: PASS ...   -> refresh the lock: scripts/lock.sh, run the tests, commit requirements/
#   check_latest: BROKEN ... -> a new release broke something: fix it (or bound the range in
#                               pyproject.toml), then refresh the lock as above
# Exit code 0 on PASS, 1 on BROKEN; CI runs it report-only (`|| true`).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
venv="$work/venv"
PIP=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
broken=""
step() {  # step NAME CMD...: run, remember the first failure
    local name=$1; shift
    echo "check_latest: $name"
    if ! "$@"; then broken=${broken:-$name}; return 1; fi
}
step "venv from open ranges" bash -c "
    '$PY' -m venv '$venv' && ${PIP[*]} --upgrade pip && ${PIP[*]} torch==2.13.0 &&
    ${PIP[*]} '.[dev]' && ${PIP[*]} --no-deps 'text-generation>=0.7'" || true
if [ -z "$broken" ]; then
    "$venv/bin/python" - <<'PY'
import re
from importlib.metadata import distributions
from pathlib import Path
pins = {}
for line in Path("requirements/lock.txt").read_text().splitlines():
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
    if m:
        pins[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
drift = []
for dist in distributions():
    name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
    if name in pins and pins[name] != dist.version:
        drift.append(f"{name} {pins[name]} -> {dist.version}")
print("check_latest: newer than the lock:", ", ".join(sorted(drift)) or "nothing")
PY
    step "SmolLM2 conversion" "$venv/bin/python" -m integration.smollm2 --dest "$work/smollm2" || true
    step "tests" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
        tests/install/test_declared_imports.py tests/install/test_layout.py \
        tests/kernels tests/memory tests/integration/test_shard_e2e.py tests/runner/test_runner_smollm2.py || true
fi
if [ -z "$broken" ]; then
    echo "check_latest: PASS with the latest releases (refresh the lock: scripts/lock.sh)"
else
    echo "check_latest: BROKEN with the latest releases at step '$broken' (the lock still holds; see above)"
    exit 1
fi
