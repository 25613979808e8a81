#!/usr/bin/env bash
# Lint, format and type checks with the locked tools in .venv (scripts/setup.sh installs ruff and
# mypy from requirements/lock.txt; their settings are in pyproject.toml): ruff check, ruff format
# --check, then mypy on tgi_paged_backend/ and tgi_paged_kernels/ with the .venv's Python (so torch's
# and transformers' annotations are seen). Every check runs; the exit status is non-zero on any
# finding. CI runs it before the tests; .pre-commit-config.yaml runs the same checks on a commit.
set -uo pipefail
cd "$(dirname "$0")/.."
failed=()
.venv/bin/ruff check . || failed+=("ruff check")
.venv/bin/ruff format --check . || failed+=("ruff format --check")
.venv/bin/python -m mypy || failed+=("mypy")
if ((${#failed[@]})); then
    printf 'lint: failed: %s\n' "$(IFS=,; echo "${failed[*]}")" >&2
    exit 1
fi
echo "lint: ruff check, ruff format --check and mypy passed"
