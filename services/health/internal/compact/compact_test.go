package compact

import (
	"context"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/testwait"
)

func kvOf(t *testing.T, ctx context.Context, c *bus.Conn, bucket string) jetstream.KeyValue {
	t.Helper()
	kv, err := c.JS.KeyValue(ctx, bucket)
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

// msgs is the number of messages (values and markers) bucket holds.
func msgs(t *testing.T, ctx context.Context, c *bus.Conn, bucket string) uint64 {
	t.Helper()
	s, err := c.JS.Stream(ctx, "KV_"+bucket)
	if err != nil {
		t.Fatal(err)
	}
	return s.CachedInfo().State.Msgs
}

// watched is what a watcher started now sees of kv: key -> operation.
func watched(t *testing.T, ctx context.Context, kv jetstream.KeyValue) map[string]jetstream.KeyValueOp {
	t.Helper()
	w, err := kv.WatchAll(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = w.Stop() }()
	seen := map[string]jetstream.KeyValueOp{}
	for e := range w.Updates() {
		if e == nil {
			return seen
		}
		seen[e.Key()] = e.Operation()
	}
	t.Fatal("the watch ended")
	return nil
}

// TestOldMarkersGoAndYoungOnesStay: deleted and purged keys leave markers;
// a round at a time past the horizon removes them, leaving the live keys'
// values, and one before it keeps them.
func TestOldMarkersGoAndYoungOnesStay(t *testing.T) {
	c := bustest.Start(t)
	ctx := testwait.Context(t, 30*time.Second)
	kv := kvOf(t, ctx, c, bus.BucketProxies)
	for _, k := range []string{"px-a", "px-b", "px-c", "px-d"} {
		if _, err := kv.Put(ctx, k, []byte(`{"id":"`+k+`"}`)); err != nil {
			t.Fatal(err)
		}
	}
	if err := kv.Delete(ctx, "px-a"); err != nil {
		t.Fatal(err)
	}
	if err := kv.Purge(ctx, "px-b"); err != nil {
		t.Fatal(err)
	}
	if n := msgs(t, ctx, c, bus.BucketProxies); n != 4 {
		t.Fatalf("before: %d messages, want 2 values and 2 markers", n)
	}
	cp := New(c, Config{After: 24 * time.Hour}, slog.New(slog.DiscardHandler))

	r, err := cp.Bucket(ctx, bus.BucketProxies, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if r.Removed != 0 || r.Kept != 2 {
		t.Fatalf("a round before the horizon: %+v, want both markers kept", r)
	}
	if n := msgs(t, ctx, c, bus.BucketProxies); n != 4 {
		t.Fatalf("after a round before the horizon: %d messages, want 4", n)
	}

	r, err = cp.Bucket(ctx, bus.BucketProxies, time.Now().Add(25*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if r.Removed != 2 || r.Kept != 0 {
		t.Fatalf("a round past the horizon: %+v, want both markers removed", r)
	}
	if n := msgs(t, ctx, c, bus.BucketProxies); n != 2 {
		t.Fatalf("after: %d messages, want the 2 live values", n)
	}
	want := map[string]jetstream.KeyValueOp{"px-c": jetstream.KeyValuePut, "px-d": jetstream.KeyValuePut}
	if got := watched(t, ctx, kv); len(got) != len(want) || got["px-c"] != want["px-c"] || got["px-d"] != want["px-d"] {
		t.Fatalf("a new watcher sees %v, want %v", got, want)
	}
	if e, err := kv.Get(ctx, "px-c"); err != nil || string(e.Value()) != `{"id":"px-c"}` {
		t.Fatalf("px-c after the round: %v", err)
	}
	// A second round finds nothing: it is safe to repeat.
	if r, err := cp.Bucket(ctx, bus.BucketProxies, time.Now().Add(25*time.Hour)); err != nil || r.Removed != 0 {
		t.Fatalf("a second round: %+v, %v", r, err)
	}
}

// TestPurgeSparesALaterValue: a key written again after its marker was
// read (a pool applied again under its name) keeps its new value: the
// purge stops at the marker's sequence.
func TestPurgeSparesALaterValue(t *testing.T) {
	c := bustest.Start(t)
	ctx := testwait.Context(t, 30*time.Second)
	kv := kvOf(t, ctx, c, bus.BucketPools)
	if _, err := kv.Put(ctx, "demo", []byte("v1")); err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(ctx, "demo"); err != nil {
		t.Fatal(err)
	}
	old, kept, err := markers(ctx, kv, time.Now().Add(time.Hour))
	if err != nil || len(old) != 1 || kept != 0 {
		t.Fatalf("markers: %d old, %d kept, %v; want demo's", len(old), kept, err)
	}
	if _, err := kv.Put(ctx, "demo", []byte("v2")); err != nil {
		t.Fatal(err)
	}
	stream, err := c.JS.Stream(ctx, "KV_"+bus.BucketPools)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := purge(ctx, stream, bus.BucketPools, old); err != nil || n != 1 {
		t.Fatalf("purge: %d, %v", n, err)
	}
	e, err := kv.Get(ctx, "demo")
	if err != nil || string(e.Value()) != "v2" {
		t.Fatalf("demo after the purge of its old marker: %v; want v2 kept", err)
	}
}

// TestRunCompactsEveryBucket: the loop compacts each of its buckets.
func TestRunCompactsEveryBucket(t *testing.T) {
	c := bustest.Start(t)
	ctx := testwait.Context(t, 60*time.Second)
	for _, b := range Buckets {
		kv := kvOf(t, ctx, c, b)
		if _, err := kv.Put(ctx, "gone", []byte("x")); err != nil {
			t.Fatal(err)
		}
		if err := kv.Delete(ctx, "gone"); err != nil {
			t.Fatal(err)
		}
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- New(c, Config{Every: 50 * time.Millisecond, After: time.Nanosecond}, slog.New(slog.DiscardHandler)).Run(rctx)
	}()
	for _, b := range Buckets {
		testwait.Until(t, 30*time.Second, "the marker in "+b+" removed", func() bool { return msgs(t, ctx, c, b) == 0 })
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestHealthIdentityCompacts runs deploy/nats as shipped: the health
// identity may compact its buckets, and the operator may not purge them.
func TestHealthIdentityCompacts(t *testing.T) {
	ctx := testwait.Context(t, 60*time.Second)
	url, secrets, admin := bustest.DeployFleet(t, ctx, filepath.Join("..", "..", "..", "..", "deploy", "nats"))
	health := bustest.ConnectAs(t, ctx, url, secrets, "health")
	for _, b := range Buckets {
		kv := kvOf(t, ctx, health, b)
		if _, err := kv.Put(ctx, "gone", []byte("x")); err != nil {
			t.Fatalf("health writes %s: %v", b, err)
		}
		if err := kv.Delete(ctx, "gone"); err != nil {
			t.Fatal(err)
		}
	}
	cp := New(health, Config{After: time.Hour}, slog.New(slog.DiscardHandler))
	for _, b := range Buckets {
		r, err := cp.Bucket(ctx, b, time.Now().Add(2*time.Hour))
		if err != nil || r.Removed != 1 {
			t.Fatalf("health compacts %s: %+v, %v", b, r, err)
		}
	}
	operator := bustest.ConnectAs(t, ctx, url, secrets, "operator")
	if _, err := kvOf(t, ctx, admin, bus.BucketProxies).Put(ctx, "stays", []byte("x")); err != nil {
		t.Fatal(err)
	}
	s, err := operator.JS.Stream(ctx, "KV_"+bus.BucketProxies)
	if err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := s.Purge(short); err == nil {
		t.Fatal("the operator purged fleet-proxies")
	}
	if _, err := kvOf(t, ctx, admin, bus.BucketProxies).Get(ctx, "stays"); err != nil {
		t.Fatalf("fleet-proxies after the operator's refused purge: %v", err)
	}
}
