package bus

import (
	"context"
	"errors"
	"log/slog"

	"github.com/nats-io/nats.go/jetstream"
)

// ErrWatchEnded is [EachUpdate]'s error when the watcher's updates end
// before its context.
var ErrWatchEnded = errors.New("the watch ended")

// EachUpdate calls fn with each update of w, in order, on the caller's
// goroutine, until ctx ends (it returns nil) or w's updates end (it returns
// [ErrWatchEnded]). A nil entry marks the end of the values the bucket held
// when the watch started. The caller still stops w ([StopWatch]).
func EachUpdate(ctx context.Context, w jetstream.KeyWatcher, fn func(jetstream.KeyValueEntry)) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-w.Updates():
			if !ok {
				return ErrWatchEnded
			}
			fn(e)
		}
	}
}

// Held reports whether kv holds key now, read directly. The mark that ends
// a watch's initial values ([EachUpdate]'s nil entry), like the end of a
// listing of keys, can come before a key that is being rewritten while the
// bucket is read: the rewrite arrives after the mark. So a key that was
// held before and is missing from them is not gone until Held says so. A
// key deleted, purged or expired is not held; any other error is returned.
func Held(ctx context.Context, kv jetstream.KeyValue, key string) (bool, error) {
	_, err := kv.Get(ctx, key)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, jetstream.ErrKeyNotFound):
		return false, nil
	}
	return false, err
}

// Gone reports whether a key that was held before and is missing from a
// reload's initial values (or a listing) is gone from kv, by [Held]. A
// failed read counts as not gone, and log says so: the caller keeps the
// key until its next reload.
func Gone(ctx context.Context, kv jetstream.KeyValue, key string, log *slog.Logger) bool {
	held, err := Held(ctx, kv, key)
	if err != nil && ctx.Err() == nil {
		log.Warn("cannot tell whether a key missing from a reload is gone; it is kept until the next reload", "bucket", kv.Bucket(), "key", key, "err", err)
	}
	return err == nil && !held
}

// StopWatch stops a KV watcher and drains its updates. The watcher's
// delivery blocks on a full updates channel and would never see the stop
// otherwise, leaving its goroutine behind; the channel closes once delivery
// has ended. A nil w (a watch that failed to start) is nothing to stop.
func StopWatch(w jetstream.KeyWatcher) {
	if w == nil {
		return // no watch was started (it failed, or ctx ended first)
	}
	_ = w.Stop()
	for range w.Updates() {
	}
}
