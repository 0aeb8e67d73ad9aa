//go:build tools

// Package tools pins Helm, which crates/testenv builds to lint, render and install
// charts/steward in the tests.
package tools

import _ "helm.sh/helm/v4/cmd/helm"
