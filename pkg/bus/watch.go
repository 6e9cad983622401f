package bus

import "github.com/nats-io/nats.go/jetstream"

// StopWatch stops a KV watcher and drains its updates. The watcher's
// delivery blocks on a full updates channel and would never see the stop
// otherwise, leaving its goroutine behind; the channel closes once delivery
// has ended.
func StopWatch(w jetstream.KeyWatcher) {
	_ = w.Stop()
	for range w.Updates() {
	}
}
