// Package agent is the runtime every backend agent shares. A backend supplies
// a [Driver]; [Runtime] consumes the agent's own command subject, runs the
// driver under a per-command deadline, publishes what it observed to
// FLEET_EVENTS before acknowledging, heartbeats into fleet-agents, and answers
// info, inventory and check requests as the "fleet-agent" micro service.
package agent

import (
	"context"
	"net/netip"
	"time"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
)

// Driver is the seam every backend implements. Every method takes ctx first
// and must return when it ends.
//
// Create and Delete are idempotent: Create finds an instance an earlier
// attempt made (by its deterministic name) instead of making a second one,
// and returns it with the same provider ID; Delete of something already
// gone returns nil or an error wrapping [ErrNotFound] (each backend says
// which). Get of an instance that is gone returns an error wrapping
// [ErrNotFound]; one that exists but stopped for good is [StateTerminated]
// in Get and in List alike, which is how the runtime's recheck finds it.
// List returns only instances carrying the proxyfleet marker of the
// agent's entry, every one once (across all pages of the backend's
// listing), cheaply (no per-instance address lookups); instances without
// the marker are never touched. Check never fails as a whole: it reports
// one [Verdict] per thing it checked.
//
// [proxyfleet/pkg/agent/agenttest.RunDriverConformance] checks a backend
// against this contract.
type Driver interface {
	Create(ctx context.Context, spec Spec) (Instance, error)
	Get(ctx context.Context, ref Ref) (Instance, error)
	Delete(ctx context.Context, ref Ref) error
	List(ctx context.Context) ([]Instance, error)
	Check(ctx context.Context) []Verdict
}

// Preparer is an optional [Driver] capability: reserve the provider ID
// before any slow work, so the runtime can record it in the provisioning
// event and a retry after a crash finds the instance by it (Proxmox reserves
// the VMID here). Spec.ProviderID holds the ID an earlier attempt recorded,
// if any; Prepare must return it unchanged when it is still valid.
type Preparer interface {
	Prepare(ctx context.Context, spec Spec) (providerID string, err error)
}

// Spec is everything a driver needs to create one instance. UserData and
// Auth.Password are secrets: never log them.
type Spec struct {
	ProxyID    string
	Pool       string
	Entry      string
	Target     string
	Name       string // deterministic instance name, events.InstanceName(ProxyID)
	ProviderID string // set when Prepare or an earlier attempt recorded one
	Attempt    int
	Image      string
	Profile    string
	Port       int
	Auth       *events.ProxyAuth
	UserData   []byte
	// Egress is what the proxy may reach: the pool's allowance and the
	// agent's allowed endpoints. Every driver makes its proxy enforce it.
	Egress egress.Policy
}

// SpecOf is the spec a driver builds create command cmd's instance from:
// its proxy spec, secrets (already unsealed), the provider id an earlier
// attempt recorded, and the egress policy of the pool's allowance plus the
// agent's own allowed endpoints. An allowance that does not make a policy
// is an [ErrPermanent] error.
func SpecOf(cmd events.CreateCommand, providerID string, allowed []netip.AddrPort) (Spec, error) {
	s := Spec{
		ProxyID: cmd.ProxyID, Pool: cmd.Pool, Entry: cmd.Entry, Target: cmd.Target,
		Name: cmd.Instance, ProviderID: providerID, Attempt: cmd.Attempt,
		Image: cmd.Image, Profile: cmd.Profile, Port: cmd.Port, Auth: cmd.Auth, UserData: cmd.UserData,
	}
	pol, err := cmd.Egress.Policy(allowed)
	if err != nil {
		return Spec{}, Wrapf(ErrPermanent, "%w", err)
	}
	s.Egress = pol
	return s, nil
}

// Marker returns the garbage-collection marker the instance must carry.
func (s Spec) Marker() Marker {
	return Marker{ProxyID: s.ProxyID, Pool: s.Pool, Entry: s.Entry}
}

// Marker identifies an instance as proxyfleet's. Instances without it are
// never touched.
type Marker struct {
	ProxyID string `json:"proxyID"`
	Pool    string `json:"pool"`
	Entry   string `json:"entry"`
}

// Ref points at an existing instance.
type Ref struct {
	ProxyID    string
	Name       string
	ProviderID string
}

// State is what a driver observed of an instance.
type State string

// Instance states.
const (
	// StateProvisioning: the instance exists but has no usable address yet.
	StateProvisioning State = "provisioning"
	// StateRunning: the instance runs and Address answers.
	StateRunning State = "running"
	// StateTerminated: the instance exists but stopped for good.
	StateTerminated State = "terminated"
)

// Instance is one backend object behind a proxy.
type Instance struct {
	Name       string `json:"name"`
	ProviderID string `json:"providerID,omitempty"`
	Marker     Marker `json:"marker"`
	State      State  `json:"state,omitempty"`
	// Address is host:port of the proxy, set when State is running.
	Address string `json:"address,omitempty"`
	Detail  string `json:"detail,omitempty"`
}

// Verdict is the outcome of one health check of a target.
type Verdict struct {
	Check  string `json:"check"`
	OK     bool   `json:"ok"`
	Detail string `json:"detail,omitempty"`
}

// TargetCheck is the value of a target's key "<entry>.<target>" in the
// fleet-targets bucket: the health service's last poll of the target
// agent's checks. Health writes it; the planner reads it to keep new
// proxies off a target whose checks fail.
type TargetCheck struct {
	Entry    string    `json:"entry"`
	Target   string    `json:"target"`
	Verdicts []Verdict `json:"verdicts"`
	// OK is true when the agent answered and every verdict passed.
	OK bool `json:"ok"`
	// At is when health polled the agent.
	At time.Time `json:"at"`
	// Error is why the agent's answer is missing, when it is.
	Error string `json:"error,omitempty"`
}

// Info is what an agent announces about itself.
type Info struct {
	Entry    string   `json:"entry"`
	Target   string   `json:"target"`
	Type     string   `json:"type"`
	Images   []string `json:"images,omitempty"`
	Profiles []string `json:"profiles,omitempty"`
	// Capacity is how many proxies the target may hold; 0 means unlimited.
	Capacity int    `json:"capacity"`
	Version  string `json:"version,omitempty"`
	// Labels describe where the target's proxies egress (region, country,
	// provider, …), from the agent's configuration; the planner records
	// them on every proxy it places here. See [events.LabelRule].
	Labels map[string]string `json:"labels,omitempty"`
}
