//go:build tools

// Package tools pins Prometheus: the server that scrapes an operator in the monitoring test,
// and promtool, which unit-tests deploy/monitoring's alert rules.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
