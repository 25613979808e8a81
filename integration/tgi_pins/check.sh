#!/usr/bin/env bash
# Co-installation proof: this package next to the TGI 3.3 image's pins, in a throwaway venv, then the
# proto/contract tests (tests/server) against the installed package.
#
#   integration/tgi_pins/check.sh                       # pins: constraints.txt, pip resolves our ranges
#   PINS=integration/tgi_pins/constraints-uvlock.txt MODE=image integration/tgi_pins/check.sh
#
# MODE=resolve (default): `pip install -c PINS <checkout>` -- our dependency ranges must admit the pins.
# MODE=image: what integration/Dockerfile does -- the pins installed first (standing in for the image),
#             then this package with --no-deps plus only the missing requirements.
# torch: the image's 2.7.0 is not installable here; torch==2.13.0 (the local CPU wheel) stands in.
# TGI_PINS_VENV=DIR keeps the venv (default: a temp dir, removed at the end).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PINS="$(cd "$(dirname "${PINS:-$HERE/constraints.txt}")" && pwd)/$(basename "${PINS:-$HERE/constraints.txt}")"
MODE="${MODE:-resolve}"
PY="${PYTHON:-python3}"
START=$(date +%s)

if [[ -n "${TGI_PINS_VENV:-}" ]]; then
  VENV="$TGI_PINS_VENV"
else
  TMP="$(mktemp -d /tmp/tgi-pins.XXXXXX)"
  VENV="$TMP/venv"
  trap 'rm -rf "$TMP"' EXIT
fi

echo "== venv $VENV ($MODE, pins $(basename "$PINS"))"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install torch==2.13.0

# The package is built from a copy: a build in the checkout would leave build/ and *.egg-info behind.
SRC="$(mktemp -d /tmp/tgi-pins-src.XXXXXX)"
trap 'rm -rf "$SRC" ${TMP:+"$TMP"}' EXIT
cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/tgi_paged_backend" "$ROOT/tgi_paged_kernels" "$SRC/"
find "$SRC" -name __pycache__ -prune -exec rm -rf {} +

case "$MODE" in
  resolve)
    "${PIP[@]}" install -c "$PINS" "$SRC" pytest
    ;;
  image)
    "${PIP[@]}" install -r "$PINS" packaging pytest
    "${PIP[@]}" install --no-deps "$SRC"
    mapfile -t missing < <("$VENV/bin/python" "$HERE/missing_requirements.py" tgi-paged-backend)
    if ((${#missing[@]})); then
      echo "installing missing requirements: ${missing[*]}"
      "${PIP[@]}" install -c "$PINS" "${missing[@]}"
    fi
    conflicts="$("$VENV/bin/python" "$HERE/missing_requirements.py" tgi-paged-backend --conflicts)"
    [[ -z "$conflicts" ]] || printf 'WARNING: installed versions outside our ranges:\n%s\n' "$conflicts"
    ;;
  *) echo "MODE must be resolve or image" >&2; exit 2 ;;
esac

echo "== pinned versions in the venv"
"$VENV/bin/python" - "$PINS" <<'PY'
import sys
from importlib import metadata
from packaging.requirements import Requirement

bad = []
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    req = Requirement(line)
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        have = "absent"
    print(f"  {req.name:32} pinned {str(req.specifier):12} installed {have}")
    if have != "absent" and not req.specifier.contains(have):
        bad.append(req.name)
print(f"  {'torch':32} {'(stand-in)':19} installed {metadata.version('torch')}")
sys.exit(f"pins not honoured: {bad}" if bad else 0)
PY

echo "== tests/server against the installed package"
cd "$SRC"  # outside the checkout: `import tgi_paged_backend` must resolve to the installed copy
rm -rf "$SRC/tgi_paged_backend" "$SRC/tgi_paged_kernels" "$SRC/build"
cp -r "$ROOT/tests" "$SRC/tests"
"$VENV/bin/python" -c "import tgi_paged_backend; print('  imported from', tgi_paged_backend.__file__)"
# The RPC fuzzer is no contract test and needs Hypothesis (a dev dependency): the locked suite runs it.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" tests/server --ignore=tests/server/test_rpc_fuzz.py "$@"
echo "== ok in $(( $(date +%s) - START ))s"
