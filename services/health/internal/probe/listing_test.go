package probe

import (
	"context"
	"encoding/json"
	"log/slog"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

// A listing of the bucket can miss a key that is being rewritten at that
// moment (its end-of-listing mark comes early), and every member rewrites
// its key each beat. A member must not drop a live peer for that: while
// three peers renew as fast as they can, every renewal of a fourth lists
// all four.
func TestRenewalKeepsPeersWhoseKeysAreBeingRewritten(t *testing.T) {
	c := bustest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	kv, err := c.JS.KeyValue(ctx, bus.BucketHealth)
	if err != nil {
		t.Fatal(err)
	}
	peers := []string{"health-b", "health-c", "health-d"}
	for _, p := range peers {
		if _, err := kv.Put(ctx, p, []byte("{}")); err != nil {
			t.Fatal(err)
		}
	}
	want := append([]string{"health-a"}, peers...)

	halt := bustest.Rewriters(t, peers, func(p string) error {
		_, err := kv.Put(ctx, p, []byte("{}"))
		return err
	})

	m := &membership{kv: kv, self: "health-a", beat: 100 * time.Millisecond, ttl: bus.HealthMemberTTL, started: time.Now(), log: slog.New(slog.DiscardHandler)}
	// The first renewal has no earlier listing to check a short one
	// against: renew until one lists everyone.
	for i := 0; !slices.Equal(m.list(), want); i++ {
		if i == 100 {
			t.Fatalf("100 renewals and none listed %v; the last listed %v", want, m.list())
		}
		if _, err := m.renew(ctx, 0); err != nil {
			t.Fatal(err)
		}
	}
	const renewals = 300
	short := 0
	for i := range renewals {
		if _, err := m.renew(ctx, 0); err != nil {
			t.Fatalf("renewal %d: %v", i, err)
		}
		if got := m.list(); !slices.Equal(got, want) {
			short++
			if short <= 5 {
				t.Errorf("renewal %d: members %v, want %v", i, got, want)
			}
		}
	}
	if short > 0 {
		t.Errorf("%d of %d renewals saw fewer members than are live", short, renewals)
	}

	// The direct read does not keep a member that left: its deleted key
	// reads as not found.
	halt()
	if err := kv.Delete(ctx, "health-d"); err != nil {
		t.Fatal(err)
	}
	if _, err := m.renew(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if got, want := m.list(), want[:3]; !slices.Equal(got, want) {
		t.Errorf("after health-d left: members %v, want %v", got, want)
	}
}

// A watch's initial values can end before a key rewritten meanwhile
// (bus.Held), and the projection rewrites a proxy's value at each change.
// A reload of the proxies view must neither stop probing such a proxy
// (which would also reset its streak) nor delete its probe record: while
// three proxies' values are rewritten as fast as they can be, after every
// reload all three are still probed and none of their records is queued
// for deletion. A proxy whose key was deleted and its marker cleaned up
// while no watch ran is forgotten, and its record deleted, by the next.
func TestReloadKeepsProxiesWhoseValuesAreBeingRewritten(t *testing.T) {
	c := bustest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, err := New(c, Config{EchoURL: "http://127.0.0.1:1/"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	open := func(name string) jetstream.KeyValue {
		kv, err := c.JS.KeyValue(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		return kv
	}
	b := buckets{proxies: open(bus.BucketProxies), probes: open(bus.BucketProbes)}
	// Not run: what a reload queues stays in pending.
	b.records = newRecordWriter(c.JS, b.probes, slog.New(slog.DiscardHandler))
	ids := []string{"demo-a", "demo-b", "demo-c"}
	body := map[string][]byte{}
	for _, id := range ids {
		body[id], _ = json.Marshal(events.ProxyView{ID: id, Pool: "demo", State: events.ProxyReady, Address: "127.0.0.1:1"})
		if _, err := b.proxies.Put(ctx, id, body[id]); err != nil {
			t.Fatal(err)
		}
		if _, err := b.probes.Put(ctx, id, []byte(`{"ok":true}`)); err != nil {
			t.Fatal(err)
		}
	}
	// reload watches the view once and returns the proxies probed and
	// the records queued for deletion once its initial values are in.
	reload := func() (probed, dropped []string) {
		t.Helper()
		lctx, lcancel := context.WithCancel(ctx)
		defer lcancel()
		w, err := b.proxies.WatchAll(lctx)
		if err != nil {
			t.Fatal(err)
		}
		defer bus.StopWatch(w)
		err = p.loop(lctx, w, b, map[string]bool{}, func() {
			p.mu.Lock()
			probed = slices.Sorted(maps.Keys(p.proxies))
			p.mu.Unlock()
			b.records.mu.Lock()
			for id, op := range b.records.pending {
				if op.del {
					dropped = append(dropped, id)
				}
			}
			b.records.mu.Unlock()
			slices.Sort(dropped)
			lcancel()
		})
		if err != nil && lctx.Err() == nil { // once lctx ends, the watch's updates may end first
			t.Fatalf("loop: %v", err)
		}
		return probed, dropped
	}
	if probed, dropped := reload(); !slices.Equal(probed, ids) || len(dropped) > 0 {
		t.Fatalf("first load: probed %v, records dropped %v; want %v and none", probed, dropped, ids)
	}

	halt := bustest.Rewriters(t, ids, func(id string) error {
		_, err := b.proxies.Put(ctx, id, body[id])
		return err
	})
	for i := range 200 {
		if probed, dropped := reload(); !slices.Equal(probed, ids) || len(dropped) > 0 {
			t.Fatalf("reload %d while the proxies' values are rewritten: probed %v, records dropped %v; want %v and none", i, probed, dropped, ids)
		}
	}
	halt()

	if err := b.proxies.Delete(ctx, "demo-c"); err != nil {
		t.Fatal(err)
	}
	if err := b.proxies.PurgeDeletes(ctx, jetstream.DeleteMarkersOlderThan(-1)); err != nil {
		t.Fatal(err)
	}
	probed, dropped := reload()
	if want := []string{"demo-a", "demo-b"}; !slices.Equal(probed, want) || !slices.Equal(dropped, []string{"demo-c"}) {
		t.Errorf("reload after demo-c was deleted: probed %v, records dropped %v; want %v and [demo-c]", probed, dropped, want)
	}
}
