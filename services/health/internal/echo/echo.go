// Package echo is the egress echo endpoint the health service serves for
// tests and LAN use: GET / answers {"ip":"<caller's address>"}, so a probe
// sent through a proxy learns the address the proxy egresses from. In
// production the prober points at a public echo URL instead.
package echo

import (
	"encoding/json"
	"net"
	"net/http"
)

// Handler answers GET (and HEAD) on any path with the caller's IP as JSON.
func Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "only GET is served here", http.StatusMethodNotAllowed)
			return
		}
		host, _, err := net.SplitHostPort(r.RemoteAddr)
		if err != nil {
			host = r.RemoteAddr
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		_ = json.NewEncoder(w).Encode(struct {
			IP string `json:"ip"`
		}{host})
	})
}

// URL returns the URL under which a server listening on addr ("host:port")
// is reached; an unspecified host (":8480", "0.0.0.0:8480") becomes the
// loopback address.
func URL(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "http://" + addr + "/"
	}
	if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port) + "/"
}
