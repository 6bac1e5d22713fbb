#!/usr/bin/env bash
# Install a real etcd (Debian's etcd-server, binary /usr/bin/etcd) for the etcd3 backend's tests.
# The tests start their own etcd on free 127.0.0.1 ports; nothing needs to run as a service.
set -euo pipefail
if command -v etcd >/dev/null 2>&1; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q etcd-server
etcd --version | head -1
