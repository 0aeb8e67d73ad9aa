//go:build tools

// Package tools pins CoreDNS (the real node's cluster DNS), which crates/testenv builds.
package tools

import _ "github.com/coredns/coredns"
