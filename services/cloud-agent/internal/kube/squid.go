package kube

import (
	"fmt"
	"strings"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
)

// Paths inside the Squid container; the Pod's Secret is mounted at configDir.
const (
	configDir    = "/etc/proxyfleet"
	squidConfKey = "squid.conf"
	htpasswdKey  = "htpasswd"
)

// squidWritableDirs are where Squid may write in its container, whose root
// filesystem is read-only: each is an emptyDir volume. squidConf writes
// nothing to disk (TestSquidPodRunsReadOnly runs it without them); they are
// for images whose Squid does.
var squidWritableDirs = []struct{ volume, path string }{
	{"run", "/run/squid"},
	{"spool", "/var/spool/squid"},
	{"cache", "/var/cache/squid"},
	{"log", "/var/log/squid"},
	{"tmp", "/tmp"},
}

// squidConf returns the Squid configuration of one proxy: listening on port,
// enforcing the egress policy pol, demanding basic auth when auth is set,
// logging to the container's streams, caching nothing and hiding the
// client. pod is the Pod's name, which is its host name: the kubelet's
// /etc/hosts maps it to the Pod's addresses, and Squid resolves it when it
// reads the configuration, so the own-address acl holds the Pod's own
// addresses, which a pool's allowed range would otherwise open (a sidecar
// listening on them, or Squid itself). The Pod's addresses never change,
// and a Squid that cannot resolve the name refuses to start.
func squidConf(pod string, port int, auth *events.ProxyAuth, authHelper string, pol egress.Policy) string {
	var b strings.Builder
	fmt.Fprintf(&b, "http_port %d\n", port)
	b.WriteString(pol.SquidRules(egress.SquidOwn{Host: pod}))
	b.WriteString("pid_filename none\n")
	// The ICMP pinger needs a raw socket; the container has no capabilities.
	b.WriteString("pinger_enable off\n")
	// A deleted Pod's Squid would otherwise wait 30 s for its clients
	// before exiting; the proxy is being removed, so they are cut sooner.
	b.WriteString("shutdown_lifetime 3 seconds\n")
	b.WriteString("cache_log /dev/stderr\n")
	b.WriteString("access_log stdio:/dev/stdout squid\n")
	b.WriteString("cache deny all\n")
	b.WriteString(egress.SquidHideClient())
	b.WriteString(egress.SquidMarkOwnErrors())
	if auth != nil {
		fmt.Fprintf(&b, "auth_param basic program %s %s/%s\n", authHelper, configDir, htpasswdKey)
		b.WriteString("auth_param basic realm proxyfleet\n")
		b.WriteString("acl proxyfleet_users proxy_auth REQUIRED\n")
		b.WriteString("http_access allow proxyfleet_users\n")
		b.WriteString("http_access deny all\n")
	} else {
		// The pool asked for no authentication: the proxy is open to whoever
		// reaches the Pod, so network policy must fence it.
		b.WriteString("http_access allow all\n")
	}
	return b.String()
}
