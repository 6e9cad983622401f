package agenttest

import (
	"context"
	"slices"
	"strings"
	"sync"

	"proxyfleet/pkg/agent"
)

// Instant is a [agent.Driver] for tests and benchmarks whose instances
// exist the moment they are created: every instance runs at once at
// Address (one proxy the test serves for all of them), so the cost of a
// fleet's convergence is the control plane's alone.
type Instant struct {
	// Address is every instance's proxy address.
	Address string

	mu    sync.Mutex
	insts map[string]agent.Instance
}

// NewInstant returns an instant driver whose instances answer at address.
func NewInstant(address string) *Instant {
	return &Instant{Address: address, insts: map[string]agent.Instance{}}
}

// Create records spec's instance as running, or returns the one recorded.
func (d *Instant) Create(_ context.Context, spec agent.Spec) (agent.Instance, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if i, ok := d.insts[spec.Name]; ok {
		return i, nil
	}
	i := agent.Instance{Name: spec.Name, ProviderID: spec.Name, Marker: spec.Marker(), State: agent.StateRunning, Address: d.Address}
	d.insts[spec.Name] = i
	return i, nil
}

// Get returns the instance, or agent.ErrNotFound.
func (d *Instant) Get(_ context.Context, ref agent.Ref) (agent.Instance, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if i, ok := d.insts[ref.Name]; ok {
		return i, nil
	}
	return agent.Instance{}, agent.ErrNotFound
}

// Delete forgets the instance; deleting one that is gone succeeds.
func (d *Instant) Delete(_ context.Context, ref agent.Ref) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.insts, ref.Name)
	return nil
}

// List returns every instance, ordered by name.
func (d *Instant) List(context.Context) ([]agent.Instance, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]agent.Instance, 0, len(d.insts))
	for _, i := range d.insts {
		out = append(out, i)
	}
	slices.SortFunc(out, func(a, b agent.Instance) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// Check has nothing to check.
func (d *Instant) Check(context.Context) []agent.Verdict {
	return []agent.Verdict{{Check: "instant", OK: true}}
}

// Len is how many instances exist.
func (d *Instant) Len() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.insts)
}
