#!/usr/bin/env bash
# Regenerate the generate.v3 Python stubs in tgi_paged_backend/server/pb/.
#
# The stubs are generated with grpcio-tools 1.70.0, whose protoc emits code that needs
# protobuf >= 5.29 at runtime. That keeps them importable in the TGI 3.3 image
# (its uv.lock installs protobuf 5.29.3, grpcio 1.70.0) and with current protobuf releases. A newer grpcio-tools
# would stamp a newer minimum version into the files and break the TGI image.
#
# Usage: scripts/gen_proto.sh            (creates a throwaway venv in $PROTOGEN_VENV)
#        PROTOGEN_VENV=/some/venv scripts/gen_proto.sh
set -euo pipefail

GRPCIO_TOOLS_VERSION="1.70.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PB_DIR="$ROOT/tgi_paged_backend/server/pb"
VENV="${PROTOGEN_VENV:-/tmp/protogen}"

if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import grpc_tools, importlib.metadata as m, sys; \
sys.exit(m.version('grpcio-tools') != '$GRPCIO_TOOLS_VERSION')" 2>/dev/null; then
  "$VENV/bin/pip" install --quiet "grpcio-tools==$GRPCIO_TOOLS_VERSION"
fi

cd "$PB_DIR"
rm -f generate_pb2.py generate_pb2.pyi generate_pb2_grpc.py
"$VENV/bin/python" -m grpc_tools.protoc -I. \
  --python_out=. --pyi_out=. --grpc_python_out=. generate.proto

# protoc writes `import generate_pb2 as generate__pb2`; the stubs live in a package.
sed -i -E 's/^import generate_pb2 as generate__pb2$/from . import generate_pb2 as generate__pb2/' \
  generate_pb2_grpc.py
grep -q '^from . import generate_pb2 as generate__pb2$' generate_pb2_grpc.py

echo "generated: $(ls "$PB_DIR" | grep -E '^generate_pb2' | tr '\n' ' ')"
