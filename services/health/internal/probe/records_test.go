package probe

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/testwait"
)

// Writes queued while the writer is busy are coalesced per key: the bucket
// gets each key's latest write, once, and a delete queued after a put wins.
func TestRecordWriterKeepsTheLatestWrite(t *testing.T) {
	ctx := testwait.Context(t, 30*time.Second)
	c := bustest.Start(t)
	kv, err := c.JS.KeyValue(ctx, bus.BucketProbes)
	if err != nil {
		t.Fatal(err)
	}
	stream, err := c.JS.Stream(ctx, "KV_"+bus.BucketProbes)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "gone", []byte(`{"id":"gone"}`)); err != nil {
		t.Fatal(err)
	}

	w := newRecordWriter(c.JS, kv, slog.New(slog.DiscardHandler))
	w.put("a", []byte(`{"v":1}`))
	w.put("a", []byte(`{"v":2}`))
	w.put("b", []byte(`{"v":1}`))
	w.del("b")
	w.del("gone")
	w.put("c", []byte(`{"v":1}`))

	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); w.run(rctx) }()
	defer func() { stop(); <-done }()

	// One put before the writer ran, then a, c and the deletes of b and
	// gone: five messages, a written once.
	if testwait.For(ctx, func() bool {
		info, err := stream.Info(ctx)
		return err == nil && info.State.LastSeq >= 5
	}) != nil {
		t.Fatal("timed out waiting for the batch in the stream")
	}
	if info, _ := stream.Info(ctx); info.State.LastSeq != 5 {
		t.Fatalf("stream holds %d messages, want 5 (a coalesced to one put)", info.State.LastSeq)
	}
	want := map[string]string{"a": `{"v":2}`, "c": `{"v":1}`, "b": "", "gone": ""}
	for k, v := range want {
		if got := value(ctx, t, kv, k); got != v {
			t.Errorf("%s: got %q, want %q", k, got, v)
		}
	}

	// Writes queued while it runs go out too.
	w.put("a", []byte(`{"v":3}`))
	if testwait.For(ctx, func() bool { return value(ctx, t, kv, "a") == `{"v":3}` }) != nil {
		t.Fatal("timed out waiting for a's third record")
	}
}

func value(ctx context.Context, t *testing.T, kv jetstream.KeyValue, key string) string {
	t.Helper()
	e, err := kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return ""
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(e.Value())
}
