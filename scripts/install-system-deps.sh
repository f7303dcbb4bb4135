#!/usr/bin/env bash
# Installs the Debian packages the test suite needs, when they are missing.
# Needs root (as on the project's machines and CI); does nothing when all are there.
set -euo pipefail
need=()
# command -> Debian package
declare -A packages=(
    [java]=openjdk-17-jre-headless  # PySpark (the spark extra, tests/spark)
    [redis-server]=redis-server     # Redis Streams, a peer of the benchmarks
    [nats-server]=nats-server       # NATS JetStream, a peer of the benchmarks
    [prometheus]=prometheus         # scrapes a live cluster in tests/integration/test_prometheus.py
    [etcd]=etcd-server              # the PM's metadata in high availability (docs/pm.md)
)
for cmd in "${!packages[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || need+=("${packages[$cmd]}")
done
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "missing system packages: ${need[*]} (run as root, or install them: apt-get install ${need[*]})" >&2
    exit 1
fi
echo "installing system packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
