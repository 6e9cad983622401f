package agenttest

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
)

// Harness is what [RunDriverConformance] needs of a backend.
type Harness struct {
	// New returns a driver on a backend of its own, holding none of the
	// driver's instances, with the hooks the suite drives that backend
	// by. Every subtest calls it once, with the subtest's t.
	New func(t *testing.T) Backend
	// MissingDelete is what the backend's Delete of an instance that is
	// gone returns: nil, or [agent.ErrNotFound] (the [agent.Driver]
	// contract allows either; the backend states which).
	MissingDelete error
	// PageSize is how many instances one page of the backend's List
	// holds as New sets it up, or 0 when List does not page.
	PageSize int
	// NoBoot, when not empty, says why instances of this test backend
	// never run (a guest image without an operating system): the suite
	// then does not wait for one to.
	NoBoot string
}

// Backend is one driver and the hooks that act on its backend behind its
// back, as its world (an operator, a kubelet, a host event) would.
type Backend struct {
	Driver agent.Driver
	// Spec returns a spec the backend can create for proxyID, its Name
	// events.InstanceName(proxyID).
	Spec func(proxyID string) agent.Spec
	// Foreign makes instances the driver must neither list nor touch: at
	// least one without the proxyfleet marker, named name, and where the
	// backend can hold them others, such as another entry's. intact
	// reports whether all of them are still there, unchanged.
	Foreign func(t *testing.T, name string) (intact func() bool)
	// Boot, when set, plays the part of the backend's world a created
	// instance waits for to run (a kubelet reporting the Pod running, a
	// DHCP lease); nil when the backend, or its fake, gets there alone.
	Boot func(t *testing.T, ref agent.Ref)
	// Stop stops the instance behind ref for good behind the driver's
	// back, as an operator, a preemption or a crash would, and returns the
	// Detail that Get and List must then report with StateTerminated.
	Stop func(t *testing.T, ref agent.Ref) (detail string)
}

// RunDriverConformance checks a backend against the [agent.Driver]
// contract, one subtest per clause: a repeated Create makes no second
// instance; Delete of an instance that is gone is the backend's
// MissingDelete, and Get of it is not found; List returns the marked
// instances of the driver's entry and never touches others; an instance
// stopped behind the driver's back is terminated in Get and List; List
// returns every instance once, across pages.
func RunDriverConformance(t *testing.T, h Harness) {
	t.Helper()
	if h.MissingDelete != nil && !errors.Is(h.MissingDelete, agent.ErrNotFound) {
		t.Fatalf("Harness.MissingDelete = %v: the Driver contract allows nil or agent.ErrNotFound", h.MissingDelete)
	}
	t.Run("CreateIsIdempotent", func(t *testing.T) { createIsIdempotent(t, h) })
	t.Run("DeleteIsIdempotent", func(t *testing.T) { deleteIsIdempotent(t, h) })
	t.Run("ListOnlyMarked", func(t *testing.T) { listOnlyMarked(t, h) })
	t.Run("StoppedIsTerminated", func(t *testing.T) { stoppedIsTerminated(t, h) })
	t.Run("ListEveryPage", func(t *testing.T) { listEveryPage(t, h) })
}

// conformanceCtx bounds one subtest.
func conformanceCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 4*Timeout)
	t.Cleanup(cancel)
	return ctx
}

// newProxyID is a proxy id no earlier run used: backends such as a shared
// libvirtd keep instance names across test runs.
func newProxyID() string { return events.NewProxyID("conf") }

func refOf(s agent.Spec, inst agent.Instance) agent.Ref {
	return agent.Ref{ProxyID: s.ProxyID, Name: s.Name, ProviderID: inst.ProviderID}
}

// create creates s and checks what Create returned: the instance named
// and marked as s, provisioning or running, with an address when running.
func create(ctx context.Context, t *testing.T, d agent.Driver, s agent.Spec) agent.Instance {
	t.Helper()
	inst, err := d.Create(ctx, s)
	if err != nil {
		t.Fatalf("Create %s (attempt %d): %v", s.ProxyID, s.Attempt, err)
	}
	switch {
	case inst.Name != s.Name || inst.Marker != s.Marker():
		t.Fatalf("Create %s = %+v, want name %s and marker %+v", s.ProxyID, inst, s.Name, s.Marker())
	case inst.State != agent.StateProvisioning && inst.State != agent.StateRunning:
		t.Fatalf("Create %s = %+v, want provisioning or running", s.ProxyID, inst)
	case inst.State == agent.StateRunning && inst.Address == "":
		t.Fatalf("Create %s = %+v: running without an address", s.ProxyID, inst)
	}
	return inst
}

// list returns List's instances, failing t on an error.
func list(ctx context.Context, t *testing.T, d agent.Driver) []agent.Instance {
	t.Helper()
	got, err := d.List(ctx)
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	return got
}

// named returns the instances of list named name.
func named(list []agent.Instance, name string) []agent.Instance {
	var out []agent.Instance
	for _, i := range list {
		if i.Name == name {
			out = append(out, i)
		}
	}
	return out
}

// wantGone checks that ref is gone: Get is not found and List does not
// hold it.
func wantGone(ctx context.Context, t *testing.T, d agent.Driver, ref agent.Ref) {
	t.Helper()
	if got, err := d.Get(ctx, ref); !errors.Is(err, agent.ErrNotFound) {
		t.Errorf("Get %s = %+v, %v; want an error wrapping agent.ErrNotFound", ref.Name, got, err)
	}
	if got := named(list(ctx, t, d), ref.Name); len(got) != 0 {
		t.Errorf("List holds %+v, want no %s", got, ref.Name)
	}
}

// wantMissingDelete checks that Delete of ref, which is gone, returns what
// the backend states.
func wantMissingDelete(ctx context.Context, t *testing.T, h Harness, d agent.Driver, ref agent.Ref) {
	t.Helper()
	err := d.Delete(ctx, ref)
	if (h.MissingDelete == nil && err != nil) || (h.MissingDelete != nil && !errors.Is(err, h.MissingDelete)) {
		t.Errorf("Delete of %s, which is gone = %v, want %v", ref.Name, err, h.MissingDelete)
	}
}

// createIsIdempotent: a redelivered create command and a later attempt
// after a crash each find the instance the first made.
func createIsIdempotent(t *testing.T, h Harness) {
	b := h.New(t)
	ctx := conformanceCtx(t)
	s := b.Spec(newProxyID())
	first := create(ctx, t, b.Driver, s)
	again := create(ctx, t, b.Driver, s) // the same command, redelivered
	s.Attempt++
	later := create(ctx, t, b.Driver, s) // the next attempt after a crash
	for _, inst := range []agent.Instance{again, later} {
		if inst.ProviderID != first.ProviderID {
			t.Errorf("a repeated Create returned provider ID %q, want the first's %q", inst.ProviderID, first.ProviderID)
		}
		if inst.State == agent.StateRunning && first.State == agent.StateRunning && inst.Address != first.Address {
			t.Errorf("a repeated Create returned address %s, want the first's %s", inst.Address, first.Address)
		}
	}
	var ours []agent.Instance
	for _, inst := range list(ctx, t, b.Driver) {
		if inst.Marker.ProxyID == s.ProxyID {
			ours = append(ours, inst)
		}
	}
	if len(ours) != 1 || ours[0].Name != s.Name || ours[0].ProviderID != first.ProviderID || ours[0].Marker != s.Marker() {
		t.Fatalf("List after three creates holds %+v for proxy %s; want exactly one, %s with provider ID %q and marker %+v",
			ours, s.ProxyID, s.Name, first.ProviderID, s.Marker())
	}
}

// deleteIsIdempotent: Delete removes an instance; Delete of one that is
// gone, deleted or never made, is the backend's MissingDelete, and Get of
// it is not found.
func deleteIsIdempotent(t *testing.T, h Harness) {
	b := h.New(t)
	ctx := conformanceCtx(t)
	never := b.Spec(newProxyID())
	neverRef := agent.Ref{ProxyID: never.ProxyID, Name: never.Name}
	wantMissingDelete(ctx, t, h, b.Driver, neverRef)
	wantGone(ctx, t, b.Driver, neverRef)

	s := b.Spec(newProxyID())
	ref := refOf(s, create(ctx, t, b.Driver, s))
	if err := b.Driver.Delete(ctx, ref); err != nil {
		t.Fatalf("Delete %s: %v", s.Name, err)
	}
	wantGone(ctx, t, b.Driver, ref)
	wantMissingDelete(ctx, t, h, b.Driver, ref)
}

// listOnlyMarked: List returns the instances carrying the marker of the
// driver's entry, and a delete for a proxy whose instance name an unmarked
// instance holds leaves that instance alone.
func listOnlyMarked(t *testing.T, h Harness) {
	b := h.New(t)
	ctx := conformanceCtx(t)
	foreignProxy := newProxyID()
	foreignName := events.InstanceName(foreignProxy)
	intact := b.Foreign(t, foreignName)
	s := b.Spec(newProxyID())
	inst := create(ctx, t, b.Driver, s)
	got := list(ctx, t, b.Driver)
	if len(got) != 1 || got[0].Name != s.Name || got[0].Marker != s.Marker() || got[0].ProviderID != inst.ProviderID {
		t.Errorf("List = %+v, want only %s with marker %+v and provider ID %q", got, s.Name, s.Marker(), inst.ProviderID)
	}
	// The outcome of such a delete is the backend's; what it must not do is
	// touch the instance.
	_ = b.Driver.Delete(ctx, agent.Ref{ProxyID: foreignProxy, Name: foreignName})
	if !intact() {
		t.Errorf("the instances without this entry's marker changed after List and a Delete of %s", foreignName)
	}
}

// stoppedIsTerminated: an instance that ran and was stopped for good
// behind the driver's back is terminated in Get and in List, and is
// deleted like any other.
func stoppedIsTerminated(t *testing.T, h Harness) {
	b := h.New(t)
	ctx := conformanceCtx(t)
	s := b.Spec(newProxyID())
	ref := refOf(s, create(ctx, t, b.Driver, s))
	if b.Boot != nil {
		b.Boot(t, ref)
	}
	if h.NoBoot == "" {
		waitRunning(ctx, t, b.Driver, ref)
	} else {
		t.Logf("not waiting for %s to run: %s", s.Name, h.NoBoot)
	}
	if got := named(list(ctx, t, b.Driver), s.Name); len(got) != 1 || got[0].State == agent.StateTerminated {
		t.Fatalf("List before the stop holds %+v, want one %s not terminated", got, s.Name)
	}

	detail := b.Stop(t, ref)
	got, err := b.Driver.Get(ctx, ref)
	if err != nil || got.State != agent.StateTerminated || got.Detail != detail || got.Name != s.Name || got.Marker != s.Marker() {
		t.Errorf("Get after the stop = %+v, %v; want %s terminated with detail %q and marker %+v", got, err, s.Name, detail, s.Marker())
	}
	listed := named(list(ctx, t, b.Driver), s.Name)
	if len(listed) != 1 || listed[0].State != agent.StateTerminated || listed[0].Detail != detail || listed[0].Marker != s.Marker() {
		t.Errorf("List after the stop holds %+v, want one %s terminated with detail %q and marker %+v", listed, s.Name, detail, s.Marker())
	}
	if err := b.Driver.Delete(ctx, ref); err != nil {
		t.Fatalf("Delete of the terminated %s: %v", s.Name, err)
	}
	wantGone(ctx, t, b.Driver, ref)
}

// waitRunning polls Get until ref runs with an address, as the runtime
// does after a create.
func waitRunning(ctx context.Context, t *testing.T, d agent.Driver, ref agent.Ref) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, Timeout)
	defer cancel()
	for {
		inst, err := d.Get(ctx, ref)
		switch {
		case err != nil && agent.Classify(err) != agent.ClassTransient:
			t.Fatalf("Get %s while waiting for it to run: %v", ref.Name, err)
		case err == nil && inst.State == agent.StateTerminated:
			t.Fatalf("Get %s while waiting for it to run = %+v", ref.Name, inst)
		case err == nil && inst.State == agent.StateRunning:
			if inst.Address == "" {
				t.Fatalf("Get %s = %+v: running without an address", ref.Name, inst)
			}
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s not running after %s: last Get = %+v, %v", ref.Name, Timeout, inst, err)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// listEveryPage: List returns each of more instances than one page holds
// exactly once (three when List does not page).
func listEveryPage(t *testing.T, h Harness) {
	b := h.New(t)
	ctx := conformanceCtx(t)
	n := max(2*h.PageSize+1, 3)
	want := make([]string, 0, n)
	for range n {
		s := b.Spec(newProxyID())
		create(ctx, t, b.Driver, s)
		want = append(want, s.Name)
	}
	var got []string
	for _, inst := range list(ctx, t, b.Driver) {
		got = append(got, inst.Name)
	}
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Fatalf("List over pages of %d returned %v, want each of %v once", h.PageSize, got, want)
	}
}
