package fleetview

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
)

func TestProxiesPagedFromTheSortedIndex(t *testing.T) {
	s := New()
	// Inserted out of order, some moved between pools, some removed.
	for i := 999; i >= 0; i-- {
		id := fmt.Sprintf("p-%04d", i)
		s.PutProxy(id, &events.ProxyView{ID: id, Pool: "a", State: events.ProxyRunning})
	}
	for i := 0; i < 1000; i += 10 {
		id := fmt.Sprintf("p-%04d", i)
		s.PutProxy(id, &events.ProxyView{ID: id, Pool: "a", State: events.ProxyReady})
	}
	s.PutProxy("p-0001", nil)
	s.PutProxy("p-0002", &events.ProxyView{ID: "p-0002", Pool: "b", State: events.ProxyReady})
	s.PutPool("a", &Pool{Name: "a", Size: 998})

	pg := s.Proxies("a", "", 100)
	if pg.Total != 998 || len(pg.Rows) != 100 || pg.Offset != 0 || pg.Rows[0].Proxy.ID != "p-0000" || pg.Rows[1].Proxy.ID != "p-0003" || pg.Next != pg.Rows[99].Proxy.ID {
		t.Fatalf("first page: total %d, %d rows from %s, next %q", pg.Total, len(pg.Rows), pg.Rows[0].Proxy.ID, pg.Next)
	}
	seen := 0
	for after := ""; ; {
		pg := s.Proxies("a", after, 100)
		for i, r := range pg.Rows {
			if r.Proxy.ID <= after || (i > 0 && r.Proxy.ID <= pg.Rows[i-1].Proxy.ID) {
				t.Fatalf("page after %q out of order at %s", after, r.Proxy.ID)
			}
		}
		seen += len(pg.Rows)
		if pg.Next == "" {
			break
		}
		after = pg.Next
	}
	if seen != 998 {
		t.Fatalf("the pages hold %d proxies, want 998", seen)
	}
	// After an id that is gone: the page starts at the next one.
	if pg := s.Proxies("a", "p-0001", 2); pg.Rows[0].Proxy.ID != "p-0003" || pg.Offset != 1 {
		t.Fatalf("after a removed id: %+v", pg)
	}
	sum, ok := s.Pool("a", time.Now())
	if !ok || sum.Counts.Desired != 998 || sum.Counts.Live != 998 || sum.Counts.Ready != 100 || sum.Counts.States[events.ProxyRunning] != 898 {
		t.Fatalf("counts of a: %+v", sum.Counts)
	}
	if sum, _ := s.Pool("b", time.Now()); sum.Pool != nil || sum.Counts.Live != 1 || sum.Counts.Ready != 1 {
		t.Fatalf("pool b (proxies only): %+v", sum)
	}
	s.PutProxy("p-0002", nil)
	if _, ok := s.Pool("b", time.Now()); ok {
		t.Fatal("a pool with neither a view nor proxies is still listed")
	}
}

func TestPoolKeepsNothingSecret(t *testing.T) {
	s := New()
	s.PutPool("x", &Pool{Name: "x", Spec: events.PoolSpec{Name: "x", Auth: &events.ProxyAuth{Username: "u", Password: "pw-secret"}, UserData: "ud-secret",
		External: &events.External{Proxies: []events.ExternalProxy{{URL: "http://u:ext-secret@h.example:3128"}, {URL: "u:raw-secret@h"}}}}})
	sum, _ := s.Pool("x", time.Now())
	b, _ := json.Marshal(sum.Pool)
	for _, secret := range []string{"pw-secret", "ud-secret", "ext-secret", "raw-secret"} {
		if strings.Contains(string(b), secret) {
			t.Errorf("the store keeps %q: %s", secret, b)
		}
	}
	if got := sum.Pool.Spec.External.Proxies[0].URL; got != "http://h.example:3128" {
		t.Errorf("external URL %q, want it without user information", got)
	}
}

func TestHistorySamples(t *testing.T) {
	s := New()
	s.PutPool("a", &Pool{Name: "a", Size: 3})
	for i := range HistoryLen + 5 {
		if i == 3 {
			s.PutProxy("a-1", &events.ProxyView{ID: "a-1", Pool: "a", State: events.ProxyReady})
		}
		s.Sample(time.Unix(int64(i), 0))
	}
	sum, _ := s.Pool("a", time.Now())
	if len(sum.History) != HistoryLen || sum.History[0].At.Unix() != 5 || sum.History[HistoryLen-1].Ready != 1 || sum.History[HistoryLen-1].Desired != 3 {
		t.Fatalf("history: %d samples from %v, last %+v", len(sum.History), sum.History[0].At, sum.History[len(sum.History)-1])
	}
}

// TestFollowerFollowsTheBuckets runs the follower against a real server:
// puts and deletes of every bucket reach the store, and a follower started
// later finds what the buckets hold.
func TestFollowerFollowsTheBuckets(t *testing.T) {
	ctx := testwait.Context(t, 60*time.Second)
	conn := bustest.Start(t)
	put := func(bucket, key string, v any) {
		t.Helper()
		kv, err := conn.JS.KeyValue(ctx, bucket)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(v)
		if _, err := kv.Put(ctx, key, b); err != nil {
			t.Fatal(err)
		}
	}
	del := func(bucket, key string) {
		t.Helper()
		kv, err := conn.JS.KeyValue(ctx, bucket)
		if err != nil {
			t.Fatal(err)
		}
		if err := kv.Delete(ctx, key); err != nil {
			t.Fatal(err)
		}
	}
	put(bus.BucketPools, "demo", Pool{Name: "demo", Provider: "local", Size: 2})
	put(bus.BucketProxies, "demo-a", events.ProxyView{ID: "demo-a", Pool: "demo", State: events.ProxyReady})
	put(bus.BucketProxies, "demo-gone", events.ProxyView{ID: "demo-gone", Pool: "demo", State: events.ProxyRetiring})
	del(bus.BucketProxies, "demo-gone")

	s := New()
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = NewFollower(conn.JS, s, time.Second, nil).Run(rctx); close(done) }()
	defer func() { cancel(); <-done }()
	testwait.Until(t, 20*time.Second, "the initial values", func() bool {
		sum, ok := s.Pool("demo", time.Now())
		return ok && s.Synced(bus.BucketProxies) && sum.Counts.Live == 1 && sum.Counts.Ready == 1
	})
	put(bus.BucketProxies, "demo-b", events.ProxyView{ID: "demo-b", Pool: "demo", State: events.ProxyRunning})
	put(bus.BucketProbes, "demo-b", Probe{OK: false, Streak: 2, LastError: "connect refused"})
	put(bus.BucketAgents, "local.t1", Agent{Entry: "local", Target: "t1", Version: "0.2.0", Capacity: 5})
	put(bus.BucketTargets, "local.t1", TargetCheck{Entry: "local", Target: "t1", OK: false, Verdicts: []Verdict{{Check: "disk", OK: false, Detail: "98% full"}}})
	testwait.Until(t, 20*time.Second, "the updates", func() bool {
		pg := s.Proxies("demo", "", 10)
		ts, _ := s.Targets()
		return pg.Total == 2 && pg.Rows[1].HasProbe && pg.Rows[1].Probe.LastError == "connect refused" &&
			len(ts) == 1 && ts[0].Agent != nil && ts[0].Agent.Version == "0.2.0" && ts[0].Check != nil && !ts[0].Check.OK && ts[0].Proxies == 0
	})
	del(bus.BucketPools, "demo")
	del(bus.BucketProxies, "demo-a")
	testwait.Until(t, 20*time.Second, "the deletes", func() bool {
		sum, ok := s.Pool("demo", time.Now())
		return ok && sum.Pool == nil && sum.Counts.Live == 1
	})
}

// TestReloadKeepsProxiesWhoseKeysAreBeingRewritten: a watch's initial
// values can end before a key rewritten meanwhile (bus.Held). While three
// proxies' values are rewritten as fast as they can be, every reload of
// the proxies view still holds all three when its initial values are in;
// a proxy whose key was deleted and its marker cleaned up while no watch
// ran is dropped by the next reload.
func TestReloadKeepsProxiesWhoseKeysAreBeingRewritten(t *testing.T) {
	ctx := testwait.Context(t, 2*time.Minute)
	conn := bustest.Start(t)
	kv, err := conn.JS.KeyValue(ctx, bus.BucketProxies)
	if err != nil {
		t.Fatal(err)
	}
	ids := []string{"demo-a", "demo-b", "demo-c"}
	body := map[string][]byte{}
	for _, id := range ids {
		body[id], _ = json.Marshal(events.ProxyView{ID: id, Pool: "demo", State: events.ProxyReady})
		if _, err := kv.Put(ctx, id, body[id]); err != nil {
			t.Fatal(err)
		}
	}
	s := New()
	f := NewFollower(conn.JS, s, time.Second, nil)
	reload := func() []string {
		t.Helper()
		lctx, lcancel := context.WithCancel(ctx)
		defer lcancel()
		var got []string
		if err := f.watch(lctx, bus.BucketProxies, buckets[bus.BucketProxies], func() {
			got = slices.Sorted(maps.Keys(s.keys(bus.BucketProxies)))
			lcancel()
		}); err != nil && lctx.Err() == nil { // once lctx ends, the watch's updates may end first
			t.Fatalf("watch: %v", err)
		}
		return got
	}
	if got := reload(); !slices.Equal(got, ids) {
		t.Fatalf("first load: %v, want %v", got, ids)
	}

	halt := bustest.Rewriters(t, ids, func(id string) error {
		_, err := kv.Put(ctx, id, body[id])
		return err
	})
	for i := range 200 {
		if got := reload(); !slices.Equal(got, ids) {
			t.Fatalf("reload %d while the proxies' values are rewritten: %v at the end of its initial values, want %v", i, got, ids)
		}
	}
	halt()

	if err := kv.Delete(ctx, "demo-c"); err != nil {
		t.Fatal(err)
	}
	if err := kv.PurgeDeletes(ctx, jetstream.DeleteMarkersOlderThan(-1)); err != nil {
		t.Fatal(err)
	}
	if got, want := reload(), []string{"demo-a", "demo-b"}; !slices.Equal(got, want) {
		t.Errorf("reload after demo-c was deleted: %v, want %v", got, want)
	}
}
