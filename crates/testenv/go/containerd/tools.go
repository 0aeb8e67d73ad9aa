//go:build tools

// Package tools pins containerd (the real node's container runtime), its runc shim and ctr,
// which crates/testenv builds.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
