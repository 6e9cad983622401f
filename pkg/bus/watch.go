package bus

import (
	"context"

	"github.com/nats-io/nats.go/jetstream"
)

// StopWatch stops a KV watcher and drains its updates. The watcher's
// delivery blocks on a full updates channel and would never see the stop
// otherwise, leaving its goroutine behind; the channel closes once delivery
// has ended.
func StopWatch(w jetstream.KeyWatcher) {
	_ = w.Stop()
	for range w.Updates() {
	}
}

// EachUpdate calls fn with every update w delivers, nil for the marker
// that the values the bucket held when the watch started have all been
// delivered, until ctx ends or the watch stops. It does not stop w.
func EachUpdate(ctx context.Context, w jetstream.KeyWatcher, fn func(jetstream.KeyValueEntry)) {
	for {
		select {
		case <-ctx.Done():
			return
		case e, ok := <-w.Updates():
			if !ok {
				return
			}
			fn(e)
		}
	}
}
