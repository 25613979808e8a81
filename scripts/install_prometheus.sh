#!/usr/bin/env bash
# Install the Prometheus server and promtool (Debian/Ubuntu) for tests/telemetry. Idempotent:
# does nothing when both are already on PATH. Needs root (or sudo) and apt-get.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    echo "prometheus and promtool already installed: $(command -v prometheus), $(command -v promtool)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "apt-get not found: install Prometheus (https://prometheus.io/download/) so that" \
         "'prometheus' and 'promtool' are on PATH" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
# --no-install-recommends: the package otherwise pulls node-exporter and friends.
$SUDO apt-get install -y --no-install-recommends prometheus
# The Debian package starts a system service where an init system runs; the tests start their own
# server on a private port and do not need it.
command -v prometheus >/dev/null && command -v promtool >/dev/null
echo "installed: $(command -v prometheus), $(command -v promtool)"
