package events

import (
	"fmt"
)

// Event types: the last token of an event subject.
const (
	PoolApplied = "applied"
	PoolDeleted = "deleted"
	// PoolScaled is the planner's decision to change the size of an
	// autoscaled pool: fleet.evt.pool.<name>.scaled ([PoolScaledData]).
	PoolScaled = "scaled"

	ProxyRequested    = "requested"
	ProxyProvisioning = "provisioning"
	ProxyRunning      = "running"
	ProxyReady        = "ready"
	ProxyUnhealthy    = "unhealthy"
	ProxyFailed       = "failed"
	ProxyRetiring     = "retiring"
	ProxyDeleted      = "deleted"
	ProxyAbandoned    = "abandoned"
	// ProxyDisabled is the planner's decision to take an external proxy
	// out of service for a while ([ProxyDisabledData]); only a ready
	// event (health: the time passed and a probe succeeded) or an end
	// (retiring, deleted) leaves it.
	ProxyDisabled = "disabled"
)

// Failure classes carried by [ProxyFailedData].
const (
	ClassQuota      = "quota"
	ClassPermanent  = "permanent"
	ClassTimeout    = "timeout"
	ClassVanished   = "vanished"
	ClassDeadLetter = "dead-letter"
	// ClassTerminated: the backend reports the instance exists but no
	// longer runs (a process gone, a domain shut off, a VM stopped, a Pod
	// that ended).
	ClassTerminated = "terminated"
	// ClassStuck: the create was issued MaxCreateAttempts times without
	// the proxy reaching provisioning.
	ClassStuck = "stuck"
)

// PoolAppliedData is recorded when a pool spec is accepted. Spec has no
// secrets; SecretsDigest changes when user-data or the password change.
type PoolAppliedData struct {
	Spec          PoolSpec `json:"spec"`
	Revision      int      `json:"revision"`
	SecretsDigest string   `json:"secretsDigest,omitempty"`
}

// Validate checks the data.
func (d *PoolAppliedData) Validate() error {
	if d.Revision < 1 {
		return &FieldError{Field: "revision", Reason: "must be 1 or more"}
	}
	spec := d.Spec
	if spec.Auth != nil && spec.Auth.Password == "" {
		// The log carries the public spec: the password lives in
		// fleet-secrets, so its absence here is expected.
		spec.Auth = &ProxyAuth{Username: spec.Auth.Username, Password: "(secret)"}
	}
	return spec.validate(true)
}

// PoolDeletedData is recorded when an operator deletes a pool.
type PoolDeletedData struct {
	Revision int `json:"revision"`
}

// PoolScaledData is the planner's decision to change the number of
// proxies an autoscaled pool wants, from Previous to Size, and why:
// "autoscale: 37 connections for 10 proxies" (up, at once) or
// "autoscale: 3 connections for 2 proxies after 5m0s of low demand"
// (down). The pool wants Size proxies until the next scaled or applied
// event (see [PoolSpec.SizeAfterScaled] and [PoolSpec.SizeAfterApply]).
type PoolScaledData struct {
	Size     int    `json:"size"`
	Previous int    `json:"previous"`
	Reason   string `json:"reason"`
}

// Validate checks the data.
func (d *PoolScaledData) Validate() error {
	var v ValidationError
	if d.Size < 0 || d.Size > MaxPoolSize {
		v.Add("size", fmt.Sprintf("must be between 0 and %d", MaxPoolSize), fmt.Sprint(d.Size))
	}
	if d.Previous < 0 || d.Previous > MaxPoolSize {
		v.Add("previous", fmt.Sprintf("must be between 0 and %d", MaxPoolSize), fmt.Sprint(d.Previous))
	}
	if d.Reason == "" {
		v.Add("reason", "is required", "")
	}
	return v.Err()
}

// ProxyRequestedData is the planner's decision to create a proxy on a target.
type ProxyRequestedData struct {
	ProxySpec
	Username string `json:"username,omitempty"`
	// Replaces names the proxy this one replaces, if any: that proxy is
	// retired once this one is ready.
	Replaces string `json:"replaces,omitempty"`
	// ReplaceReason says why Replaces is replaced ("rolled: …",
	// "rotated: …", "unhealthy: …", "recycled by operator"); it becomes
	// the retiring reason of the replaced proxy.
	ReplaceReason string `json:"replaceReason,omitempty"`
	// Labels are the labels the target announced when the planner placed
	// the proxy there (region, country, provider, …): recorded with the
	// decision so every fold of the log shows them on the proxy.
	Labels map[string]string `json:"labels,omitempty"`
}

// ProxySpec is what one proxy's instance is built from: the pool and
// revision it belongs to, where it runs, its instance's name and shape. The
// requested event records it ([ProxyRequestedData]) and every create
// command carries it ([CreateCommand]); agents turn it into their driver's
// spec. A field added here reaches both.
type ProxySpec struct {
	Pool     string `json:"pool"`
	Entry    string `json:"entry"`
	Target   string `json:"target"`
	Instance string `json:"instance"`
	Revision int    `json:"revision"`
	Image    string `json:"image,omitempty"`
	Profile  string `json:"profile,omitempty"`
	Port     int    `json:"port"`
	// Egress is the pool's egress allowance at the time of the request
	// (nil: the default policy).
	Egress *Egress `json:"egress,omitempty"`
}

// Clone returns a copy of s that shares nothing with it.
func (s ProxySpec) Clone() ProxySpec {
	s.Egress = s.Egress.Clone()
	return s
}

// Validate checks the data.
func (d *ProxyRequestedData) Validate() error {
	var v ValidationError
	v.AddField(CheckIdentifier("pool", d.Pool))
	v.AddField(CheckIdentifier("entry", d.Entry))
	v.AddField(CheckIdentifier("target", d.Target))
	if d.Instance == "" {
		v.Add("instance", "is required", "")
	}
	CheckLabels(&v, "labels", d.Labels)
	return v.Err()
}

// ProxyProvisioningData is the agent's observation that it started to build
// the instance. It is published before any slow work, with the provider ID
// when one is known (for Proxmox the reserved VMID).
type ProxyProvisioningData struct {
	Entry      string `json:"entry"`
	Target     string `json:"target"`
	Instance   string `json:"instance"`
	ProviderID string `json:"providerID,omitempty"`
	Attempt    int    `json:"attempt"`
}

// ProxyRunningData is the agent's observation that the instance runs and
// answers at Address (host:port).
type ProxyRunningData struct {
	ProviderID string `json:"providerID,omitempty"`
	Address    string `json:"address"`
	Attempt    int    `json:"attempt"`
}

// Validate checks the data.
func (d *ProxyRunningData) Validate() error {
	if d.Address == "" {
		return &FieldError{Field: "address", Reason: "is required"}
	}
	return nil
}

// ProxyReadyData is the health service's observation that a probe through
// the proxy succeeded after it was not ready.
type ProxyReadyData struct {
	Address   string `json:"address"`
	LatencyMS int64  `json:"latencyMs"`
	EgressIP  string `json:"egressIP,omitempty"`
}

// ProxyUnhealthyData is the health service's observation that probes failed
// Streak times in a row.
type ProxyUnhealthyData struct {
	Reason string `json:"reason"`
	Streak int    `json:"streak"`
}

// ProxyFailedData records that a proxy cannot reach or stay in service.
type ProxyFailedData struct {
	Class   string `json:"class"`
	Reason  string `json:"reason"`
	Attempt int    `json:"attempt,omitempty"`
}

// ProxyRetiringData is the planner's decision to remove a proxy.
type ProxyRetiringData struct {
	Reason string `json:"reason"`
	// SkipCleanup means the instance is left in place (the proxy becomes
	// abandoned instead of deleted).
	SkipCleanup bool `json:"skipCleanup,omitempty"`
}

// ProxyDeletedData is the agent's observation that the instance is gone.
type ProxyDeletedData struct {
	Attempt int `json:"attempt"`
}

// ProxyAbandonedData records that the proxy was dropped without cleanup.
type ProxyAbandonedData struct {
	Reason string `json:"reason"`
}

// IsTerminal reports whether a proxy in state typ is finished for good.
func IsTerminal(typ string) bool { return typ == ProxyDeleted || typ == ProxyAbandoned }

// ProxyEventID returns the deterministic id (and Nats-Msg-Id) of a proxy
// event: "<proxy>.<type>.<n>", where n distinguishes repeated facts of one
// type (the command attempt, or the sequence the fact follows).
func ProxyEventID(proxyID, typ string, n uint64) string {
	return fmt.Sprintf("%s.%s.%d", proxyID, typ, n)
}
