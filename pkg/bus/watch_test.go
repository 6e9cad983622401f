package bus_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
)

// TestStopWatchWithUnreadUpdates: a watcher stopped while its updates
// channel is full still ends, and leaves no goroutine behind (the package's
// TestMain checks for leaks).
func TestStopWatchWithUnreadUpdates(t *testing.T) {
	c := bustest.Start(t)
	ctx := context.Background()
	kv, err := c.JS.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "watch-test"})
	if err != nil {
		t.Fatal(err)
	}
	const n = 2000 // more than the updates channel holds
	for i := range n {
		if _, err := kv.Put(ctx, fmt.Sprintf("k%d", i), []byte("v")); err != nil {
			t.Fatal(err)
		}
	}
	w, err := kv.WatchAll(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Wait until delivery has filled the channel and blocks on it.
	deadline := time.Now().Add(30 * time.Second)
	for len(w.Updates()) < cap(w.Updates()) {
		if time.Now().After(deadline) {
			t.Fatalf("updates channel holds %d of %d", len(w.Updates()), cap(w.Updates()))
		}
		time.Sleep(10 * time.Millisecond)
	}
	done := make(chan struct{})
	go func() { bus.StopWatch(w); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("StopWatch did not return")
	}
}

// TestEachUpdate: the bucket's values, the nil marker after them, a later
// put and a delete arrive in order; the end of the context returns nil and
// a stopped watcher returns ErrWatchEnded.
func TestEachUpdate(t *testing.T) {
	c := bustest.Start(t)
	ctx := context.Background()
	kv, err := c.JS.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "each-update"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "a", []byte("1")); err != nil {
		t.Fatal(err)
	}
	w, err := kv.WatchAll(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	var got []string
	err = bus.EachUpdate(wctx, w, func(e jetstream.KeyValueEntry) {
		switch {
		case e == nil:
			got = append(got, "loaded")
			if _, err := kv.Put(ctx, "b", []byte("2")); err != nil {
				t.Error(err)
			}
		case e.Operation() == jetstream.KeyValuePut:
			got = append(got, "put "+e.Key())
			if e.Key() == "b" {
				if err := kv.Delete(ctx, "a"); err != nil {
					t.Error(err)
				}
			}
		default:
			got = append(got, "delete "+e.Key())
			cancel()
		}
	})
	if err != nil {
		t.Errorf("EachUpdate after its context ended = %v, want nil", err)
	}
	if want := "put a,loaded,put b,delete a"; strings.Join(got, ",") != want {
		t.Errorf("updates %q, want %q", strings.Join(got, ","), want)
	}
	bus.StopWatch(w)
	if err := bus.EachUpdate(ctx, w, func(jetstream.KeyValueEntry) { t.Error("an update after the stop") }); !errors.Is(err, bus.ErrWatchEnded) {
		t.Errorf("EachUpdate of a stopped watcher = %v, want ErrWatchEnded", err)
	}
}

// TestStopWatchOfNoWatch: a loop whose watch failed to start (the planner's
// credential sync at shutdown, its context ended) stops it all the same.
func TestStopWatchOfNoWatch(t *testing.T) {
	var w jetstream.KeyWatcher
	bus.StopWatch(w)
}

// TestHeldKeysMissingFromTheInitialValues: while three writers rewrite
// their keys as fast as they can, the keys a watch delivers before its
// end-of-initial-values mark can lack one of them (the rewrite comes after
// the mark). Held reads each such key as held; a deleted, a purged and an
// expired key read as not held.
func TestHeldKeysMissingFromTheInitialValues(t *testing.T) {
	c := bustest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	kv, err := c.JS.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "held", LimitMarkerTTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	keys := []string{"a", "b", "c"}
	for _, k := range keys {
		if _, err := kv.Put(ctx, k, []byte("v")); err != nil {
			t.Fatal(err)
		}
	}
	halt := bustest.Rewriters(t, keys, func(k string) error {
		_, err := kv.Put(ctx, k, []byte("v"))
		return err
	})
	short := 0
	const watches = 300
	for range watches {
		w, err := kv.WatchAll(ctx)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for e := range w.Updates() {
			if e == nil {
				break
			}
			seen[e.Key()] = true
		}
		bus.StopWatch(w)
		if len(seen) < len(keys) {
			short++
		}
		for _, k := range keys {
			if seen[k] {
				continue
			}
			held, err := bus.Held(ctx, kv, k)
			if err != nil || !held {
				t.Fatalf("key %s, missing from a watch's initial values while rewritten: Held = %v, %v; want true", k, held, err)
			}
		}
	}
	halt()
	t.Logf("%d of %d watches marked the end of their initial values before every key", short, watches)

	if err := kv.Delete(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if err := kv.Purge(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Create(ctx, "d", []byte("v"), jetstream.KeyTTL(time.Second)); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		held, err := bus.Held(ctx, kv, "d")
		if err != nil {
			t.Fatal(err)
		}
		if !held {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a key with a TTL of a second still reads as held after 20 s")
		}
	}
	for k, want := range map[string]bool{"a": false, "b": false, "c": true, "never": false} {
		if held, err := bus.Held(ctx, kv, k); err != nil || held != want {
			t.Errorf("Held(%s) = %v, %v; want %v", k, held, err, want)
		}
	}
}

// TestGoneKeepsAKeyItCannotRead: a key held is not gone, a deleted one is;
// a read that fails (the connection closed) keeps the key and says why.
func TestGoneKeepsAKeyItCannotRead(t *testing.T) {
	c := bustest.Start(t)
	ctx := context.Background()
	kv, err := c.JS.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "gone"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "a", []byte("v")); err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "b", []byte("v")); err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	var logs strings.Builder
	log := slog.New(slog.NewTextHandler(&logs, nil))
	if bus.Gone(ctx, kv, "a", log) || !bus.Gone(ctx, kv, "b", log) {
		t.Errorf("Gone(a), Gone(b) = %v, %v; want false, true", bus.Gone(ctx, kv, "a", log), bus.Gone(ctx, kv, "b", log))
	}
	if logs.Len() != 0 {
		t.Errorf("reads that answered logged %q", logs.String())
	}
	c.NC.Close()
	if bus.Gone(ctx, kv, "b", log) {
		t.Error("a key whose read failed counts as gone")
	}
	if !strings.Contains(logs.String(), "kept until the next reload") || !strings.Contains(logs.String(), "bucket=gone") {
		t.Errorf("failed read logged %q; want the bucket and that the key is kept", logs.String())
	}
}
