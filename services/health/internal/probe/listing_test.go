package probe

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
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

	stop := make(chan struct{})
	var wg sync.WaitGroup
	halt := sync.OnceFunc(func() { close(stop); wg.Wait() })
	defer halt()
	for _, p := range peers {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := kv.Put(ctx, p, []byte("{}")); err != nil {
					t.Errorf("put %s: %v", p, err)
					return
				}
			}
		})
	}

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
