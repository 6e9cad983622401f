package pve_test

import (
	"net/url"
	"sort"
	"sync"
	"testing"

	"proxyfleet/services/proxmox-agent/internal/pve"
	"proxyfleet/services/proxmox-agent/internal/pve/pvetest"
)

// TestContractFakeRoutes: every route, method and parameter the fake
// serves exists in the published schema.
func TestContractFakeRoutes(t *testing.T) {
	schema := pvetest.LoadSchema(t)
	for _, r := range pvetest.Routes() {
		if err := schema.Check(r.Method, r.Path, r.Params); err != nil {
			t.Error(err)
		}
	}
}

// TestContractClientCalls drives every client call against the fake and
// checks that each request it sent (method, route, parameter names) exists
// in the published schema and was served by a fake route.
func TestContractClientCalls(t *testing.T) {
	schema := pvetest.LoadSchema(t)
	fake := pvetest.Start(t, pvetest.Options{AgentPolls: 1})
	fake.AddTemplate("pve1", 9000, "debian-13")
	c := newClient(t, fake)
	var mu sync.Mutex
	type sent struct {
		method, path string
		params       []string
	}
	var calls []sent
	c.SetTrace(func(method, path string, params url.Values) {
		names := make([]string, 0, len(params))
		for k := range params {
			names = append(names, k)
		}
		sort.Strings(names)
		mu.Lock()
		calls = append(calls, sent{method, path, names})
		mu.Unlock()
	})
	ctx := ctxT(t)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	_, err := c.Version(ctx)
	must(err)
	_, err = c.Resources(ctx, "vm")
	must(err)
	id, err := c.NextID(ctx)
	must(err)
	upid, err := c.Clone(ctx, "pve1", 9000, id, pve.CloneOptions{Name: "px-a", Description: "d", Full: true, Storage: "local-lvm"})
	must(err)
	must(c.WaitTask(ctx, upid))
	_, err = c.TaskLog(ctx, "pve1", upid, 10)
	must(err)
	upid, err = c.Upload(ctx, "pve1", "proxy-seeds", "iso", "px-a.iso", isoLike())
	must(err)
	must(c.WaitTask(ctx, upid))
	must(c.SetConfig(ctx, "pve1", id, url.Values{"ide2": {"proxy-seeds:iso/px-a.iso,media=cdrom"},
		"net0": {"virtio,bridge=vmbr0,tag=4"}, "cores": {"1"}, "memory": {"512"}, "tags": {"proxyfleet"}, "agent": {"1"}, "description": {"x"}}))
	_, err = c.Config(ctx, "pve1", id)
	must(err)
	upid, err = c.Start(ctx, "pve1", id)
	must(err)
	must(c.WaitTask(ctx, upid))
	_, err = c.Status(ctx, "pve1", id)
	must(err)
	_, _ = c.NetworkInterfaces(ctx, "pve1", id) // first call: agent not up yet
	ifs, err := c.NetworkInterfaces(ctx, "pve1", id)
	must(err)
	if len(ifs) == 0 {
		t.Fatal("no interfaces")
	}
	upid, err = c.Stop(ctx, "pve1", id)
	must(err)
	must(c.WaitTask(ctx, upid))
	upid, err = c.DeleteVM(ctx, "pve1", id)
	must(err)
	must(c.WaitTask(ctx, upid))
	upid, err = c.DeleteVolume(ctx, "pve1", "proxy-seeds", "proxy-seeds:iso/px-a.iso")
	must(err)
	must(c.WaitTask(ctx, upid))

	if len(calls) < 15 {
		t.Fatalf("only %d calls traced", len(calls))
	}
	seen := map[string]bool{}
	for _, s := range calls {
		route, ok := pvetest.MatchRoute(s.method, s.path)
		if !ok {
			t.Errorf("%s %s: no route of the fake serves it", s.method, s.path)
			continue
		}
		seen[s.method+" "+route] = true
		if got := pve.Route(s.path); got != route {
			t.Errorf("Route(%q) = %q, want %q", s.path, got, route)
		}
		if err := schema.Check(s.method, route, s.params); err != nil {
			t.Error(err)
		}
	}
	for _, r := range pvetest.Routes() {
		if !seen[r.Method+" "+r.Path] {
			t.Errorf("the client never called %s %s", r.Method, r.Path)
		}
	}
}

// isoLike returns bytes that carry the ISO 9660 volume descriptor magic.
func isoLike() []byte {
	b := make([]byte, 0x8800)
	b[0x8000] = 1
	copy(b[0x8001:], "CD001")
	return b
}
