package planner

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"

	"proxyfleet/pkg/events"
)

// TestEndpointNamesAreUnique: nats micro info lists every endpoint under a
// name of its own ("pool-get", "proxy-get" …), each on its API subject, so
// their stats can be told apart.
func TestEndpointNamesAreUnique(t *testing.T) {
	h := newHarness(t)
	h.startPlanner("ep", nil)
	msg, err := h.c.NC.Request("$SRV.INFO."+ServiceName, nil, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var info micro.Info
	if err := json.Unmarshal(msg.Data, &info); err != nil {
		t.Fatal(err)
	}
	names := map[string]string{}
	for _, e := range info.Endpoints {
		if prev, dup := names[e.Name]; dup {
			t.Errorf("endpoint name %q is used for %s and %s", e.Name, prev, e.Subject)
		}
		names[e.Name] = e.Subject
	}
	for _, want := range [][3]string{{"pool", "get"}, {"proxy", "get"}, {"pool", "delete"}, {"proxy", "delete"}, {"instance", "delete"}} {
		name := want[0] + "-" + want[1]
		if got := names[name]; got != events.APISubject(want[0], want[1]) {
			t.Errorf("endpoint %s: subject %q, want %q", name, got, events.APISubject(want[0], want[1]))
		}
	}
}
