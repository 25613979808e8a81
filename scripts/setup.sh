#!/usr/bin/env bash
# Create .venv and install the package with its test extras (CPU). Idempotent.
# torch is pinned to the CPU build first so no multi-GB CUDA wheel is pulled.
# CUDA users: install the torch build matching their CUDA first (e.g. from the PyTorch index),
# then `pip install -e '.[dev]'`; triton comes with the dependency list on Linux.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip 2>/dev/null || true
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
# The official TGI client, used unchanged by the HTTP tests. Without its dependency pins: every
# release pins huggingface-hub<1, which would drag transformers back to 4.x.
.venv/bin/python -m pip install -q --disable-pip-version-check aiohttp
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps 'text-generation>=0.7'
