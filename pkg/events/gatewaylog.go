package events

import (
	"fmt"
	"regexp"
	"time"
)

// gatewayNameRE is what a gateway name may hold: it is the last token of
// its fleet-demand keys and its request log subject, a token of its micro
// service subjects, and part of its NATS identity gateway-<name>.
var gatewayNameRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// CheckGatewayName reports why name cannot name a gateway, or nil.
func CheckGatewayName(name string) error {
	if !gatewayNameRE.MatchString(name) {
		return fmt.Errorf("gateway name %q: want 1-64 letters, digits, '-' or '_'", name)
	}
	if name == GatewayLogToken {
		return fmt.Errorf("gateway name %q: it is reserved for the request log's subjects (%s); choose another", name, GatewayLogAll)
	}
	return nil
}

// Outcomes of a [GatewayRequest].
const (
	// RequestOK: a proxy's answer reached the client in full (whatever its
	// status), or a tunnel opened and later closed.
	RequestOK = "ok"
	// RequestProxyError: the answer relayed is a proxy's own error page
	// (marked [ProxyErrorHeader]) after the retries ran out.
	RequestProxyError = "proxy_error"
	// RequestError: the gateway answered itself with an error status (no
	// proxy left, a proxy unreachable, no credentials, a bad request, a
	// wrong password, a throttled client).
	RequestError = "error"
	// RequestAborted: the answer began but the client stopped reading it.
	RequestAborted = "aborted"
	// RequestClientGone: the client left before any answer.
	RequestClientGone = "client_gone"
)

// GatewayRequest is one client request as a gateway's request log records
// it on [GatewayLogSubject] (stream FLEET_GATEWAY_LOG). It never holds a
// body, a header or a credential; the path holds its query string only
// when the gateway runs with --request-log-query.
type GatewayRequest struct {
	// Time is when the request arrived.
	Time    time.Time `json:"time"`
	Gateway string    `json:"gateway"`
	// Pool and Session are what the client's username named ("" when
	// it named none, or no valid one).
	Pool    string `json:"pool"`
	Session string `json:"session"`
	// Site is the registrable domain of Host.
	Site   string `json:"site"`
	Method string `json:"method"`
	// Scheme is "http" or "https" of an absolute-form request, "" for a
	// CONNECT tunnel.
	Scheme string `json:"scheme"`
	// Host is the request's host (with its port if it gave one).
	Host string `json:"host"`
	// Path is the URL path (and "?query" only with --request-log-query);
	// "" for a tunnel.
	Path string `json:"path"`
	// Proxies are the proxies tried, in order; the last one carried the
	// answer when Outcome is ok.
	Proxies  []string `json:"proxies"`
	Attempts int      `json:"attempts"`
	// Status is the status the client received (200 for a tunnel that
	// opened), 0 when it received none.
	Status int `json:"status"`
	// BytesUp counts the client's bytes to the proxy (request body or
	// tunnel), BytesDown the bytes to the client (response body or
	// tunnel).
	BytesUp   int64 `json:"bytesUp"`
	BytesDown int64 `json:"bytesDown"`
	// DurationMS is from arrival to the end of the answer (of a tunnel: to
	// its close), in milliseconds.
	DurationMS float64 `json:"durationMs"`
	// Tier is the pool of the last proxy tried: the pool that served the
	// request when Outcome is ok. It differs from Pool when the request
	// went on to a fallback pool ([GatewaySpec.Fallback]); "" when no
	// proxy was tried.
	Tier string `json:"tier,omitempty"`
	// Ban is the pool's ban rule the answer matched, if any.
	Ban     string `json:"ban,omitempty"`
	Outcome string `json:"outcome"`
}
