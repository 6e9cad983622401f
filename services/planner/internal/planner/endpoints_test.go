package planner

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/apiserver"
)

// TestEndpointNamesAreUnique: nats micro info lists every endpoint under a
// name of its own ("pool-get", "proxy-get" …), each on its API subject, so
// their stats can be told apart. The leader's instance serves the deciding
// endpoints, every replica's the others (see writer.go): together they
// serve each endpoint once.
func TestEndpointNamesAreUnique(t *testing.T) {
	h := newHarness(t)
	r := h.startPlanner("ep", nil)
	h.waitFor("leader", r.IsLeader)
	var infos []micro.Info
	h.waitFor("both instances of the service", func() bool {
		infos = serviceInfos(t, h.c.NC)
		return len(infos) == 2
	})
	names := map[string]string{}
	roles := map[string]bool{}
	for _, info := range infos {
		roles[info.Metadata["role"]] = true
		for _, e := range info.Endpoints {
			if prev, dup := names[e.Name]; dup {
				t.Errorf("endpoint name %q is used for %s and %s", e.Name, prev, e.Subject)
			}
			names[e.Name] = e.Subject
		}
	}
	if !roles["replica"] || !roles["leader"] {
		t.Errorf("instance roles: got %v, want replica and leader", roles)
	}
	for _, want := range [][3]string{{"pool", "get"}, {"proxy", "get"}, {"pool", "delete"}, {"proxy", "delete"}, {"instance", "delete"}} {
		name := want[0] + "-" + want[1]
		if got := names[name]; got != events.APISubject(want[0], want[1]) {
			t.Errorf("endpoint %s: subject %q, want %q", name, got, events.APISubject(want[0], want[1]))
		}
	}
}

// serviceInfos gathers the info every instance of the planner's service
// answers within a second.
func serviceInfos(t *testing.T, nc *nats.Conn) []micro.Info {
	t.Helper()
	inbox := nc.NewRespInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.PublishRequest("$SRV.INFO."+apiserver.ServiceName, inbox, nil); err != nil {
		t.Fatal(err)
	}
	var out []micro.Info
	for {
		msg, err := sub.NextMsg(time.Second)
		if err != nil {
			return out
		}
		var info micro.Info
		if err := json.Unmarshal(msg.Data, &info); err != nil {
			t.Fatal(err)
		}
		out = append(out, info)
	}
}
