package projection

import (
	"time"

	"proxyfleet/pkg/events"
)

// Proxy is the fleet-proxies value of one proxy (key: the proxy id): the
// shared [events.ProxyView], which fleet.api.proxy.get answers too. A
// deleted or abandoned proxy has no key.
type Proxy = events.ProxyView

// Pool is the fleet-pools value of one pool (key: the pool name). A deleted
// pool has no key: pool.deleted removes it, because the proxies still being
// retired keep their own keys in fleet-proxies and nothing else needs the
// spec of a deleted pool.
type Pool struct {
	Name     string `json:"name"`
	Provider string `json:"provider"`
	// Size is the number of proxies the pool wants: its spec's size, or
	// for a pool with autoscale the size the planner's last pool.scaled
	// event set (see [events.PoolSpec.SizeAfterApply]).
	Size int `json:"size"`
	// ScaleReason and ScaledAt are the reason and time of the last
	// pool.scaled event since the pool has autoscale.
	ScaleReason string    `json:"scaleReason,omitempty"`
	ScaledAt    time.Time `json:"scaledAt,omitzero"`
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
