package projection_test

import (
	"testing"

	"proxyfleet/pkg/events"
	"proxyfleet/services/health/internal/projection"
)

// TestCacheGivesWayToOtherWriters: a projector keeps what it wrote to use
// in its next batches, but not once another writer wrote to the bucket,
// between its batches or in the middle of one.
func TestCacheGivesWayToOtherWriters(t *testing.T) {
	e := open(t)
	stored := e.stored
	running := func(id string) projection.Raw {
		return stored(id, events.ProxyRunning, events.ProxyRunningData{Address: "127.0.0.1:9", Attempt: 1})
	}
	p := projection.New(e.conn, nil, nil)
	apply := func(r projection.Raw) {
		t.Helper()
		if err := p.ApplyBatch(e.ctx, []projection.Raw{r}); err != nil {
			t.Fatal(err)
		}
	}
	other := func(r projection.Raw) {
		t.Helper()
		if err := projection.New(e.conn, nil, nil).Apply(e.ctx, r.Seq, r.Subject, r.Data); err != nil {
			t.Fatal(err)
		}
	}
	// p starts from empty buckets: it knows b was never written.
	apply(stored("a", events.ProxyRequested, requested("demo")))

	// Between two batches of p, another writer creates b.
	other(stored("b", events.ProxyRequested, requested("demo")))
	r := running("b")
	apply(r)
	if got, _ := e.proxy("b"); got.State != events.ProxyRunning || got.Seq != r.Seq {
		t.Fatalf("b = %+v; want running at %d", got, r.Seq)
	}

	// In the middle of a batch of p, another writer fails c, which p has
	// cached as requested: a ready probe must find it failed.
	apply(stored("c", events.ProxyRequested, requested("demo")))
	failC := stored("c", events.ProxyFailed, events.ProxyFailedData{Class: events.ClassQuota, Reason: "no capacity", Attempt: 1})
	once := false
	p.SetCrash(func(w int, _, _ string) bool {
		if w == 0 && !once {
			once = true
			other(failC)
		}
		return false
	})
	apply(running("a"))
	p.SetCrash(nil)
	if !once {
		t.Fatal("the batch wrote nothing")
	}
	apply(stored("c", events.ProxyReady, events.ProxyReadyData{Address: "127.0.0.1:9"}))
	if got, _ := e.proxy("c"); got.State != events.ProxyFailed || got.Seq != failC.Seq {
		t.Fatalf("c = %+v; want failed at %d", got, failC.Seq)
	}
}
