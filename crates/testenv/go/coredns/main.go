// CoreDNS for the real node of crates/testenv, with only the plugins its Corefile uses
// (crates/testenv/src/node/config.rs `corefile`): bind, ready, health, errors, kubernetes.
// CoreDNS's own main links all of its ~60 plugins and their cloud SDKs; this one builds in
// a fraction of the time. The directive order is CoreDNS's (core/dnsserver/zdirectives.go).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

var directives = []string{
	"bind",
	"ready",
	"health",
	"errors",
	"kubernetes",
}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}
