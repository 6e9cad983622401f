package e2e_test

import (
	"bytes"
	"context"
	"os/exec"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// TestViewsRebuildIdentically drops the KV views and rebuilds them from
// FLEET_EVENTS: the content must be identical.
func TestViewsRebuildIdentically(t *testing.T) {
	f := startFleet(t)
	f.apply(events.PoolSpec{Name: "views", Provider: "local", Size: 2})
	f.apply(events.PoolSpec{Name: "other", Provider: "local", Size: 1})
	f.waitPool("views", 2, "ready", 60*time.Second)
	f.waitPool("other", 1, "ready", 60*time.Second)
	// Quiesce: stop everything that writes, so the log is final.
	f.stop("planner")
	f.stop("local-agent")
	f.stop("health")
	before := map[string]map[string][]byte{
		bus.BucketProxies: f.views(bus.BucketProxies),
		bus.BucketPools:   f.views(bus.BucketPools),
	}
	if len(before[bus.BucketProxies]) != 3 || len(before[bus.BucketPools]) != 2 {
		t.Fatalf("views before rebuild: %d proxies, %d pools; want 3 and 2", len(before[bus.BucketProxies]), len(before[bus.BucketPools]))
	}
	cmd := exec.Command(filepath.Join(binDir, "health"), "--nats-url", f.conn.ClientURL(),
		"--data-dir", filepath.Join(f.dir, "health-rebuild"), "--rebuild-views")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("health --rebuild-views: %v\n%s", err, out)
	}
	for bucket, want := range before {
		got := f.views(bucket)
		if !sameViews(got, want) {
			t.Fatalf("%s differs after rebuild:\n got %s\nwant %s", bucket, dump(got), dump(want))
		}
	}
	// Leave no processes behind: the agent is stopped, so clean up directly.
	killBinaryProcesses(agentExe())
}

func sameViews(a, b map[string][]byte) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if !bytes.Equal(v, b[k]) {
			return false
		}
	}
	return true
}

func dump(m map[string][]byte) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b bytes.Buffer
	for _, k := range keys {
		b.WriteString(k + "=" + string(m[k]) + "\n")
	}
	return b.String()
}

// lastEventOf returns the last FLEET_EVENTS message on subjects matching
// filter.
func lastEventOf(t *testing.T, f *fleet, filter string) *nats.Msg {
	t.Helper()
	s, err := f.conn.JS.Stream(context.Background(), bus.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := s.GetLastMsgForSubject(context.Background(), filter)
	if err != nil {
		t.Fatalf("no event on %s: %v", filter, err)
	}
	return &nats.Msg{Subject: raw.Subject, Header: raw.Header, Data: raw.Data}
}
