package projection

import (
	"time"

	"proxyfleet/pkg/events"
)

// Proxy is the fleet-proxies value of one proxy (key: the proxy id). Every
// field comes from the event log, times included, so replaying the log gives
// the same bytes.
type Proxy struct {
	ID       string `json:"id"`
	Pool     string `json:"pool"`
	Entry    string `json:"entry"`
	Target   string `json:"target"`
	Instance string `json:"instance"`
	// State is the proxy's lifecycle state (see events.Transition):
	// requested, provisioning, running, ready, unhealthy, failed or
	// retiring. A deleted or abandoned proxy has no key.
	State string `json:"state"`
	// Address is host:port of the proxy once it ran; it is kept when a
	// running proxy reports provisioning again.
	Address    string `json:"address"`
	ProviderID string `json:"providerID,omitempty"`
	Attempt    int    `json:"attempt"`
	Revision   int    `json:"revision"`
	Port       int    `json:"port,omitempty"`
	Image      string `json:"image,omitempty"`
	Profile    string `json:"profile,omitempty"`
	// Username is the basic-auth user the proxy demands, if any (the
	// password is never in the log; it lives in fleet-secrets).
	Username string `json:"username,omitempty"`
	Replaces string `json:"replaces,omitempty"`

	// Reason says why the proxy is unhealthy, failed or retiring.
	Reason string `json:"reason,omitempty"`
	// FailureClass is the class of the last failure (quota, permanent, …).
	FailureClass string `json:"failureClass,omitempty"`
	SkipCleanup  bool   `json:"skipCleanup,omitempty"`
	// Streak is the failure streak reported by the last unhealthy event.
	Streak int `json:"streak,omitempty"`
	// LatencyMS and EgressIP are those of the last ready event.
	LatencyMS int64  `json:"latencyMs,omitempty"`
	EgressIP  string `json:"egressIP,omitempty"`

	CreatedAt time.Time `json:"createdAt"`
	UpdatedAt time.Time `json:"updatedAt"`
	// Seq is the FLEET_EVENTS sequence of the last event applied; an event
	// at or below it has already been applied and is skipped.
	Seq uint64 `json:"seq"`
}

// Probeable reports whether the proxy should be probed: it has an address
// and is running, ready or unhealthy.
func (p Proxy) Probeable() bool {
	if p.Address == "" {
		return false
	}
	switch p.State {
	case events.ProxyRunning, events.ProxyReady, events.ProxyUnhealthy:
		return true
	}
	return false
}

// Pool is the fleet-pools value of one pool (key: the pool name). A deleted
// pool has no key: pool.deleted removes it, because the proxies still being
// retired keep their own keys in fleet-proxies and nothing else needs the
// spec of a deleted pool.
type Pool struct {
	Name     string `json:"name"`
	Provider string `json:"provider"`
	Size     int    `json:"size"`
	// Spec is the public spec recorded by the applied event (no user-data,
	// no password).
	Spec          events.PoolSpec `json:"spec"`
	Revision      int             `json:"revision"`
	SecretsDigest string          `json:"secretsDigest,omitempty"`
	// Conditions say why the pool differs from its spec (Ready, Placed,
	// Progressing), as the planner recorded them.
	Conditions []events.Condition `json:"conditions,omitempty"`
	CreatedAt  time.Time          `json:"createdAt"`
	UpdatedAt  time.Time          `json:"updatedAt"`
	Seq        uint64             `json:"seq"`
}
