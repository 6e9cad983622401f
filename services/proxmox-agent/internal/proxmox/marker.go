package proxmox

import (
	"fmt"
	"strconv"
	"strings"

	"proxyfleet/pkg/agent"
)

// The marker lives twice on every VM: in the description (set by the clone
// itself, so a finished clone always carries it) and in tags (set when the
// VM is configured; /cluster/resources returns tags, so inventory needs no
// per-VM call).
const (
	markerTitle = "proxyfleet instance: managed by the proxmox-agent; do not edit the lines below"
	keyProxy    = "proxyfleet.proxy"
	keyPool     = "proxyfleet.pool"
	keyEntry    = "proxyfleet.entry"
	keyPort     = "proxyfleet.port"

	tagFleet = "proxyfleet"
	tagProxy = "pf-proxy-"
	tagPool  = "pf-pool-"
	tagEntry = "pf-entry-"
)

// description returns the VM description carrying m and the proxy port.
func description(m agent.Marker, port int) string {
	return fmt.Sprintf("%s\n%s: %s\n%s: %s\n%s: %s\n%s: %d\n", markerTitle,
		keyProxy, m.ProxyID, keyPool, m.Pool, keyEntry, m.Entry, keyPort, port)
}

// parseDescription reads the marker and port out of a description; ok is
// false when it carries no complete marker.
func parseDescription(desc string) (m agent.Marker, port int, ok bool) {
	for _, line := range strings.Split(desc, "\n") {
		k, v, found := strings.Cut(strings.TrimSpace(line), ":")
		if !found {
			continue
		}
		v = strings.TrimSpace(v)
		switch strings.TrimSpace(k) {
		case keyProxy:
			m.ProxyID = v
		case keyPool:
			m.Pool = v
		case keyEntry:
			m.Entry = v
		case keyPort:
			port, _ = strconv.Atoi(v)
		}
	}
	return m, port, m.ProxyID != "" && m.Entry != ""
}

// tags returns the VM tags carrying m.
func tags(m agent.Marker) string {
	return strings.Join([]string{tagFleet, tagEntry + m.Entry, tagPool + m.Pool, tagProxy + m.ProxyID}, ";")
}

// parseTags reads the marker out of a tag list; ok is false unless it is
// a complete proxyfleet marker.
func parseTags(s string) (m agent.Marker, ok bool) {
	fleet := false
	for _, t := range strings.FieldsFunc(s, func(r rune) bool { return r == ';' || r == ',' || r == ' ' }) {
		switch {
		case t == tagFleet:
			fleet = true
		case strings.HasPrefix(t, tagProxy):
			m.ProxyID = t[len(tagProxy):]
		case strings.HasPrefix(t, tagPool):
			m.Pool = t[len(tagPool):]
		case strings.HasPrefix(t, tagEntry):
			m.Entry = t[len(tagEntry):]
		}
	}
	return m, fleet && m.ProxyID != "" && m.Entry != ""
}
