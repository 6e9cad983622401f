package bustest

import (
	"context"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
)

// WaitEvent waits until the events of proxy id hold one of kind, and
// returns the last of them. It fails t at once when the proxy has a failed
// event instead (unless kind is failed), showing the failure, and after
// within, listing the kinds the proxy has.
func WaitEvent(t testing.TB, within time.Duration, store *bus.EventStore, id, kind string) bus.Event {
	t.Helper()
	var (
		found bus.Event
		seen  []string
	)
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	err := testwait.For(ctx, func() bool {
		evs, err := store.Load(context.Background(), events.AggregateProxy, id)
		if err != nil {
			t.Fatalf("proxy %s: load events: %v", id, err)
		}
		seen = seen[:0]
		ok := false
		for _, ev := range evs {
			if ev.Unreadable != nil {
				continue
			}
			seen = append(seen, ev.Kind)
			if ev.Kind == events.ProxyFailed && kind != events.ProxyFailed {
				var fd events.ProxyFailedData
				_ = ev.DecodeData(&fd)
				t.Fatalf("proxy %s failed while waiting for %s: %+v", id, kind, fd)
			}
			if ev.Kind == kind {
				found, ok = ev, true
			}
		}
		return ok
	})
	if err != nil {
		t.Fatalf("proxy %s: no %s event within %s; its events: %v", id, kind, within, seen)
	}
	return found
}
