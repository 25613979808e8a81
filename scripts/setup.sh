#!/usr/bin/env bash
# Create .venv and install exactly the committed pin set (CPU): requirements/lock.txt (with hashes;
# torch is the local CPU build torch==2.13.0, so no multi-GB CUDA wheel is pulled), this package
# editable without dependencies, and requirements/no-deps.txt (the official `text-generation`
# client). Idempotent. Regenerate the pins with scripts/lock.sh; scripts/check_latest.sh tries the
# latest releases instead.
# CUDA users: install the torch build matching their CUDA first (e.g. from the PyTorch index),
# then `pip install -e '.[dev]'` (open ranges); triton comes with the dependency list on Linux.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# A known pip (the venv's bundled one varies with the Python build).
"${PIP[@]}" 'pip==26.3'
"${PIP[@]}" --require-hashes -r requirements/lock.txt
"${PIP[@]}" --no-deps -e .
"${PIP[@]}" --no-deps --require-hashes -r requirements/no-deps.txt
