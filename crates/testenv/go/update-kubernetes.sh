#!/usr/bin/env bash
# Regenerates kubernetes/go.mod for a k8s.io/kubernetes release (the commands are in tools.go).
# The staging modules (k8s.io/api, apimachinery, client-go, ...) are `replace`d to
# ./staging/... inside k8s.io/kubernetes's own go.mod; outside that repository each
# must point at its published v0.x release. The list is read from that go.mod, never typed.
# Usage: crates/testenv/go/update-kubernetes.sh v1.37.2
set -euo pipefail
version="${1:?usage: $0 <k8s.io/kubernetes version, e.g. v1.37.2>}"
staging="v0.${version#v1.}"
here="$(cd "$(dirname "$0")" && pwd)"
gomod="$(go mod download -json "k8s.io/kubernetes@${version}" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
cd "$here/kubernetes"
{
  echo "// Builds kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, and the real"
  echo "// node's kubelet and kube-proxy, for crates/testenv."
  echo "// Regenerate with: crates/testenv/go/update-kubernetes.sh ${version}"
  echo "module steward.dev/testenv/kubernetes"
  echo
  grep -E '^go [0-9]' "$gomod"
  echo
  echo "require k8s.io/kubernetes ${version}"
  echo
  echo "replace ("
  grep -E '^\s+k8s\.io/[a-z0-9-]+ => \./staging/' "$gomod" | awk -v v="$staging" '{print "\t" $1 " => " $1 " " v}'
  echo ")"
} > go.mod
go mod tidy
