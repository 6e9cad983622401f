package probe

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
)

// recordAckWait bounds how long the writer waits for the acks of a batch.
const recordAckWait = 10 * time.Second

// recordWriter writes probe records to fleet-probes off the probes' path: a
// probe hands its record over and frees its slot. Writes of one key are
// coalesced while a batch is out, so only the latest reaches the bucket;
// batches go out one after another on one connection, so the bucket ends
// with each key's latest record, or none after a delete. Puts are published
// asynchronously and their acks checked; a write that fails is logged and
// not retried: the proxy's next probe writes its record again.
type recordWriter struct {
	js  jetstream.JetStream
	kv  jetstream.KeyValue
	log *slog.Logger

	kick chan struct{} // capacity 1: something is pending

	mu      sync.Mutex
	pending map[string]recordOp
}

// recordOp is the latest write of one key: a record, or a delete.
type recordOp struct {
	body []byte
	del  bool
}

func newRecordWriter(js jetstream.JetStream, kv jetstream.KeyValue, log *slog.Logger) *recordWriter {
	return &recordWriter{js: js, kv: kv, log: log, kick: make(chan struct{}, 1), pending: map[string]recordOp{}}
}

// put queues body as id's record.
func (w *recordWriter) put(id string, body []byte) { w.queue(id, recordOp{body: body}) }

// del queues the removal of id's record.
func (w *recordWriter) del(id string) { w.queue(id, recordOp{del: true}) }

func (w *recordWriter) queue(id string, op recordOp) {
	w.mu.Lock()
	w.pending[id] = op
	w.mu.Unlock()
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// run writes what is queued until ctx ends.
func (w *recordWriter) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.kick:
		}
		w.mu.Lock()
		batch := w.pending
		w.pending = make(map[string]recordOp, len(batch))
		w.mu.Unlock()
		w.write(ctx, batch)
	}
}

func (w *recordWriter) write(ctx context.Context, batch map[string]recordOp) {
	type sent struct {
		id  string
		ack jetstream.PubAckFuture
	}
	acks := make([]sent, 0, len(batch))
	for id, op := range batch {
		if op.del {
			if err := w.kv.Delete(ctx, id); err != nil && !errors.Is(err, jetstream.ErrKeyNotFound) && ctx.Err() == nil {
				w.log.Warn("delete probe record", "proxy", id, "err", err)
			}
			continue
		}
		// A put of the bucket's key subject, as KeyValue.Put sends it.
		ack, err := w.js.PublishAsync("$KV."+bus.BucketProbes+"."+id, op.body)
		if err != nil {
			if ctx.Err() == nil {
				w.log.Warn("write probe record", "proxy", id, "err", err)
			}
			continue
		}
		acks = append(acks, sent{id, ack})
	}
	timeout := time.NewTimer(recordAckWait)
	defer timeout.Stop()
	for i, s := range acks {
		select {
		case <-s.ack.Ok():
		case err := <-s.ack.Err():
			w.log.Warn("write probe record", "proxy", s.id, "err", err)
		case <-timeout.C:
			w.log.Warn("probe records not acknowledged in time", "records", len(acks)-i, "wait", recordAckWait.String())
			return
		case <-ctx.Done():
			return
		}
	}
}
