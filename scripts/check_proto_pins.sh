#!/usr/bin/env bash
# Run the server tests (stubs, RPCs, logging, CLI) under the TGI 3.3 image's gRPC pins
# (protobuf 5.29.4, grpcio 1.71.0), in a throwaway venv, against this checkout (not installed).
#
# CI idea: a job step `scripts/check_proto_pins.sh` next to the main test job; it needs only
# CPU and network access to the package index, and takes well under a minute once the venv exists.
#
# Usage: scripts/check_proto_pins.sh              (venv in $PINS_VENV, default /tmp/tgi-pins-venv)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PINS_VENV:-/tmp/tgi-pins-venv}"

if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet "protobuf==5.29.4" "grpcio==1.71.0" loguru typer pytest

"$VENV/bin/python" - <<'PY'
import google.protobuf, grpc
assert google.protobuf.__version__ == "5.29.4", google.protobuf.__version__
assert grpc.__version__ == "1.71.0", grpc.__version__
print(f"protobuf {google.protobuf.__version__}, grpcio {grpc.__version__}")
PY

cd "$ROOT"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/server "$@"
