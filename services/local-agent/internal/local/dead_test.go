package local

import (
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/testnet"
)

// TestDeadInstancesAreTerminated: Get and List report an instance that has
// run past its start without listening on its port as terminated with a
// detail saying so (one whose process is gone: the conformance suite's
// StoppedIsTerminated); a live listening one is running, and a young one
// that does not listen yet is provisioning.
func TestDeadInstancesAreTerminated(t *testing.T) {
	cases := []struct {
		name       string
		grace      time.Duration
		breakIt    func(t *testing.T, d *Driver, s *state)
		want       agent.State
		wantDetail string
	}{
		{"live and listening", time.Hour, func(*testing.T, *Driver, *state) {}, agent.StateRunning, ""},
		{"not listening past its start", 0, deafen, agent.StateTerminated, "does not listen on"},
		{"not listening yet", time.Hour, deafen, agent.StateProvisioning, ""},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newDriver(t, Config{})
			d.startGrace = c.grace
			ctx := ctxT(t)
			sp := spec("dead-" + string(rune('a'+i)) + "aaa")
			if _, err := d.Create(ctx, sp); err != nil {
				t.Fatalf("Create: %v", err)
			}
			c.breakIt(t, d, readState(t, d, sp.Name))
			got, err := d.Get(ctx, agent.Ref{ProxyID: sp.ProxyID, Name: sp.Name})
			if err != nil || got.State != c.want || !strings.Contains(got.Detail, c.wantDetail) {
				t.Errorf("Get = %+v, %v; want %s with detail containing %q", got, err, c.want, c.wantDetail)
			}
			list, err := d.List(ctx)
			if err != nil || len(list) != 1 || list[0].State != c.want || !strings.Contains(list[0].Detail, c.wantDetail) || list[0].Marker != sp.Marker() {
				t.Errorf("List = %+v, %v; want one %s with detail containing %q", list, err, c.want, c.wantDetail)
			}
		})
	}
}

// deafen points the instance's state at a port nothing listens on, as if
// its live process had closed its listener.
func deafen(t *testing.T, d *Driver, s *state) {
	t.Helper()
	s.Port = testnet.Refusing(t).Port
	if err := d.states.write(s); err != nil {
		t.Fatal(err)
	}
}
