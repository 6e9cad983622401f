package web

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/console/internal/fleetview"
)

// TestLiveBurstOf10000Proxies writes a pool of 10,000 proxies into the
// views, requested then ready, while a pool page's live stream is open:
// the stream sends at most one patch per coalescing interval whatever
// the burst, each holding one page of rows, and its last patch shows the
// 10,000 ready.
func TestLiveBurstOf10000Proxies(t *testing.T) {
	if testing.Short() {
		t.Skip("writes 20,000 KV values")
	}
	const n = 10_000
	ctx := testwait.Context(t, 120*time.Second)
	conn := bustest.Start(t)
	f := newFixture(t, nil)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = fleetview.NewFollower(conn.JS, f.store, time.Second, nil).Run(rctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	pools, err := conn.JS.KeyValue(ctx, bus.BucketPools)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(fleetview.Pool{Name: "big", Provider: "local", Size: n})
	if _, err := pools.Put(ctx, "big", b); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 20*time.Second, "the pool in the console", func() bool { _, ok := f.store.Pool("big", time.Now()); return ok })

	c := f.client(t)
	c.get("/pools/big")
	lctx, lcancel := context.WithCancel(ctx)
	defer lcancel()
	s := c.live(lctx, "/live/pools/big")
	s.next(t, 5*time.Second)
	start := time.Now()

	put := func(state string) {
		futures := make([]jetstream.PubAckFuture, 0, n)
		for i := range n {
			id := fmt.Sprintf("big-%05d", i)
			b, _ := json.Marshal(events.ProxyView{ID: id, Pool: "big", State: state, Entry: "local", Target: "t1"})
			// KV puts are publishes on the bucket's subjects: async, to
			// make a burst.
			fut, err := conn.JS.PublishAsync("$KV."+bus.BucketProxies+"."+id, b)
			if err != nil {
				t.Fatal(err)
			}
			futures = append(futures, fut)
			if i%1000 == 999 {
				// At most a thousand in flight: the client's bound.
				select {
				case <-conn.JS.PublishAsyncComplete():
				case <-ctx.Done():
					t.Fatal(ctx.Err())
				}
			}
		}
		for _, fut := range futures {
			select {
			case <-fut.Ok():
			case err := <-fut.Err():
				t.Fatal(err)
			case <-ctx.Done():
				t.Fatal(ctx.Err())
			}
		}
	}
	put(events.ProxyRequested)
	put(events.ProxyReady)

	patches, biggest, last := 0, 0, ""
	for {
		last = s.next(t, 30*time.Second)
		patches++
		biggest = max(biggest, len(last))
		if strings.Contains(last, `count-ready\"\u003e10000\u003c`) {
			break
		}
	}
	elapsed := time.Since(start)
	// One patch per coalescing interval at most (50ms here), and a few
	// more for the refreshes: never one per change.
	if limit := int(elapsed/(50*time.Millisecond)) + 2; patches > limit {
		t.Errorf("%d patches in %s for %d changes: more than one per coalescing interval (%d)", patches, elapsed, 2*n, limit)
	}
	if patches >= 2*n/10 {
		t.Errorf("%d patches for %d changes: not coalesced", patches, 2*n)
	}
	if rows := strings.Count(last, `\u003ctr id=\"proxy-`); rows != 100 {
		t.Errorf("the last patch holds %d rows, want one page of 100", rows)
	}
	t.Logf("%d patches in %s, the largest %d bytes", patches, elapsed, biggest)
}
