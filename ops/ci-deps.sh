#!/usr/bin/env bash
# Debian packages the ops tests need (tests/ops): systemd for systemd-analyze and
# systemd-sysusers, prometheus for promtool and the Prometheus server. Idempotent: packages
# already installed cost one dpkg query and no network. Run as root (CI does) or with sudo.
set -euo pipefail

PACKAGES=(systemd prometheus)

missing=()
for package in "${PACKAGES[@]}"; do
    if [ "$(dpkg-query -W -f='${db:Status-Status}' "$package" 2>/dev/null)" != "installed" ]; then
        missing+=("$package")
    fi
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    SUDO=(sudo)
fi
echo "ops/ci-deps.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
# --no-install-recommends: prometheus recommends node-exporter and friends, which CI does not use.
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# The package's own prometheus.service is not started (no systemd as PID 1 in CI containers);
# the tests start their own server on loopback.
