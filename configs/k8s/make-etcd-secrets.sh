#!/usr/bin/env bash
# The Secrets configs/k8s/pytorchjob.yaml needs, made with openssl:
#   bash configs/k8s/make-etcd-secrets.sh DIR [NAMESPACE]
#   kubectl apply -n NAMESPACE -f DIR/secrets.yaml
# DIR (created, mode 700) receives a CA, the etcd members' certificate (client and peer TLS), the
# agents' client certificate, two random passwords, and secrets.yaml holding three Secrets:
#   torchrevive-etcd-server-tls  (kubernetes.io/tls: tls.crt, tls.key, ca.crt)  the etcd members
#   torchrevive-etcd-client-tls  (kubernetes.io/tls: tls.crt, tls.key, ca.crt)  the agents, the auth Job
#   torchrevive-etcd-auth        (Opaque: root-password, password)              etcd's root and the agents' user
# Keep DIR private: ca.key signs certificates etcd trusts. NAMESPACE (default: default) goes into
# the members' DNS names; EXTRA_SANS (e.g. "IP:127.0.0.1,DNS:localhost", for a port-forward) adds
# names to their certificate. DAYS (default 365) is how long the certificates are valid.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: $0 DIR [NAMESPACE]" >&2
  exit 2
fi
dir=$1
namespace=${2:-default}
days=${DAYS:-365}
members=3          # the StatefulSet's replicas
service=torchrevive-etcd
peer_cn=torchrevive-etcd-peer  # the StatefulSet's --peer-cert-allowed-cn
agent_cn=torchrevive-agent     # no etcd user has this name: the certificate alone grants nothing

if [[ -e $dir/secrets.yaml ]]; then
  echo "$dir/secrets.yaml exists: refusing to replace the CA and passwords the cluster may be using" >&2
  exit 1
fi
mkdir -p "$dir"
chmod 700 "$dir"
cd "$dir"
umask 077

sans="DNS:$service,DNS:$service.$namespace.svc,DNS:$service.$namespace.svc.cluster.local"
for ((i = 0; i < members; i++)); do
  member=$service-$i.$service
  sans+=",DNS:$member,DNS:$member.$namespace.svc,DNS:$member.$namespace.svc.cluster.local"
done
if [[ -n ${EXTRA_SANS:-} ]]; then
  sans+=",$EXTRA_SANS"
fi

openssl req -x509 -newkey rsa:3072 -nodes -days "$days" -subj "/CN=torchrevive-etcd-ca" \
  -keyout ca.key -out ca.crt 2>/dev/null

# certificate NAME CN EXTENSIONS: a key and a certificate signed by the CA.
certificate() {
  printf '%s\n' "$3" > "$1.ext"
  openssl req -newkey rsa:3072 -nodes -subj "/CN=$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" \
    -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm "$1.csr" "$1.ext"
}
# The members present it to clients and, as clients themselves, to each other.
certificate server "$peer_cn" "subjectAltName=$sans
extendedKeyUsage=serverAuth,clientAuth
keyUsage=critical,digitalSignature,keyEncipherment"
certificate client "$agent_cn" "extendedKeyUsage=clientAuth
keyUsage=critical,digitalSignature,keyEncipherment"

openssl rand -hex 24 > root-password
openssl rand -hex 24 > password

b64() { base64 < "$1" | tr -d '\n'; }
{
  for role in server client; do
    cat <<EOF
apiVersion: v1
kind: Secret
metadata:
  name: torchrevive-etcd-$role-tls
type: kubernetes.io/tls
data:
  tls.crt: $(b64 $role.crt)
  tls.key: $(b64 $role.key)
  ca.crt: $(b64 ca.crt)
---
EOF
  done
  cat <<EOF
apiVersion: v1
kind: Secret
metadata:
  name: torchrevive-etcd-auth
type: Opaque
data:
  root-password: $(b64 root-password)
  password: $(b64 password)
EOF
} > secrets.yaml
echo "wrote $dir/secrets.yaml: kubectl apply -n $namespace -f $dir/secrets.yaml" >&2
