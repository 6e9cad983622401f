package bus_test

import (
	"context"
	"fmt"
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
