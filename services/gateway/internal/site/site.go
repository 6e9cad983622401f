// Package site keys the sites a gateway's rules and limits apply to: a
// proxy cooled by one site, or held to a politeness limit there, is keyed
// by the site's registrable domain, so www.example.com and
// img.example.com are one site, and example.co.uk is not co.uk.
package site

import (
	"net"
	"net/netip"
	"strings"

	"golang.org/x/net/publicsuffix"
)

// Key is the site of host (a request's host, with or without a port): its
// registrable domain ("eTLD+1", by the public suffix list) in lower case;
// an IP address or a name with no registrable domain (localhost, a bare
// suffix) is its own site. "" for an empty host.
func Key(host string) string {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.ToLower(strings.Trim(host, "[]")), ".")
	if host == "" {
		return ""
	}
	if addr, err := netip.ParseAddr(host); err == nil {
		return addr.Unmap().String()
	}
	if d, err := publicsuffix.EffectiveTLDPlusOne(host); err == nil {
		return d
	}
	return host
}
