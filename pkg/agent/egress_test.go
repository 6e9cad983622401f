package agent_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
)

// TestCreateCarriesEgress: the driver's spec holds the pool's allowance
// from the command and the agent's --egress-allow endpoints.
func TestCreateCarriesEgress(t *testing.T) {
	drv := &specDriver{memDriver: newMemDriver(), specs: map[string]agent.Spec{}}
	c := bustest.Start(t)
	ep := netip.MustParseAddrPort("127.0.0.1:8480")
	rt, err := agent.New(bustest.Dial(t, c), drv, agent.Config{
		Info: agent.Info{Entry: "mem", Target: "t1", Type: "memory"}, WatchInterval: 10 * time.Millisecond,
		EgressEndpoints: []netip.AddrPort{ep},
	}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	agenttest.Serve(t, rt.Run)
	h := &harness{t: t, conn: c, store: bus.NewEventStore(c, "test", nil), drv: drv}

	cmd := events.CreateCommand{
		ProxyID:   "p-eg",
		ProxySpec: events.ProxySpec{Pool: "p", Entry: "mem", Target: "t1", Instance: events.InstanceName("p-eg"), Port: 3128, Egress: &events.Egress{AllowCIDRs: []string{"10.1.0.0/16"}, AllowPorts: []int{8080}}},
		Attempt:   1,
	}
	if _, err := bus.PublishCreate(context.Background(), c, "test", cmd, 0); err != nil {
		t.Fatal(err)
	}
	h.waitFor("p-eg", events.ProxyRunning)
	spec, ok := drv.spec("p-eg")
	if !ok {
		t.Fatal("the driver was not asked to create p-eg")
	}
	pol := spec.Egress
	checks := []struct {
		addr    string
		port    uint16
		connect bool
		want    egress.Rule
	}{
		{"10.1.2.3", 8080, true, egress.RuleOK},
		{"10.2.0.1", 443, true, egress.RulePrivate},
		{"127.0.0.1", 8480, false, egress.RuleOK},
		{"127.0.0.1", 4222, true, egress.RulePort},
	}
	for _, c := range checks {
		if got := pol.Check(netip.MustParseAddr(c.addr), c.port, c.connect); got != c.want {
			t.Errorf("spec policy Check(%s, %d) = %q, want %q", c.addr, c.port, got, c.want)
		}
	}
}
