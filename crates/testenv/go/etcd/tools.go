//go:build tools

// Package tools pins the etcd server that crates/testenv builds.
package tools

import _ "go.etcd.io/etcd/server/v3"
