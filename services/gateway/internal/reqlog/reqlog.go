// Package reqlog is the gateway's request log: one [events.GatewayRequest]
// per client request, published to the gateway's subject of the bounded
// stream FLEET_GATEWAY_LOG. A request never waits for it: records go
// through a bounded queue to one publisher, and a record that finds the
// queue full is dropped and counted.
//
// The forward proxy begins a [Record] per request ([Logger.Start]), which
// wraps the response writer to learn the status and bytes sent, notes each
// proxy tried ([Tried]), a ban ([Banned]) and a tunnel's bytes
// ([Tunneled]), and ends it ([Logger.Finish]).
package reqlog

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"proxyfleet/pkg/events"
)

// Defaults of [Config].
const (
	DefaultQueue      = 4096
	DefaultMaxPending = 256
	// maxPath bounds a record's path, which keeps a record well under the
	// stream's largest message.
	maxPath = 2048
)

// Config configures a [Logger].
type Config struct {
	// Gateway is the gateway's name; records go to
	// events.GatewayLogSubject(Gateway).
	Gateway string
	// Sample is the share (0..1) of plain successful requests recorded;
	// errors, bans and requests that failed over are always recorded. 0
	// turns the log off ([New] returns nil).
	Sample float64
	// KeepQuery keeps the query string in a record's path.
	KeepQuery bool
	// Queue is how many records may wait for the publisher (default
	// [DefaultQueue]); past it records are dropped and counted.
	Queue int
	// MaxPending bounds the records published and not yet acknowledged by
	// the stream (default [DefaultMaxPending]).
	MaxPending int
	Log        *slog.Logger
}

// Logger queues records and publishes them. A nil *Logger logs nothing.
type Logger struct {
	cfg     Config
	subject string
	js      jetstream.JetStream
	queue   chan *events.GatewayRequest
	log     *slog.Logger
	// random draws the sample; tests replace it.
	random func() float64

	sent, dropped, failed, sampledOut atomic.Int64
	lastWarn                          atomic.Int64
}

// New returns a logger publishing on nc, or nil when cfg.Sample is 0.
func New(nc *nats.Conn, cfg Config) (*Logger, error) {
	if cfg.Sample < 0 || cfg.Sample > 1 {
		return nil, fmt.Errorf("request log sample %v: want a share from 0 (off) to 1 (every request)", cfg.Sample)
	}
	if err := events.CheckGatewayName(cfg.Gateway); err != nil {
		return nil, err
	}
	if cfg.Sample == 0 {
		return nil, nil
	}
	if cfg.Queue <= 0 {
		cfg.Queue = DefaultQueue
	}
	if cfg.MaxPending <= 0 {
		cfg.MaxPending = DefaultMaxPending
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	l := &Logger{cfg: cfg, subject: events.GatewayLogSubject(cfg.Gateway), queue: make(chan *events.GatewayRequest, cfg.Queue),
		log: cfg.Log, random: rand.Float64}
	js, err := jetstream.New(nc,
		jetstream.WithPublishAsyncMaxPending(cfg.MaxPending),
		jetstream.WithPublishAsyncErrHandler(func(_ jetstream.JetStream, _ *nats.Msg, err error) { l.publishFailed(err) }))
	if err != nil {
		return nil, err
	}
	l.js = js
	return l, nil
}

// Counts are what a [Logger] did with its records.
type Counts struct {
	// Sent were published (Failed of them then refused by the stream or
	// unanswered); Dropped found the queue full; SampledOut were plain
	// successes the sample left out.
	Sent, Dropped, Failed, SampledOut int64
}

// Counts returns the logger's counts so far.
func (l *Logger) Counts() Counts {
	if l == nil {
		return Counts{}
	}
	return Counts{Sent: l.sent.Load(), Dropped: l.dropped.Load(), Failed: l.failed.Load(), SampledOut: l.sampledOut.Load()}
}

// RegisterMetrics reports the counts as proxyfleet.gateway.request_log.records
// by result (sent, dropped, failed, sampled_out).
func (l *Logger) RegisterMetrics(meter metric.Meter) error {
	if l == nil {
		return nil
	}
	c, err := meter.Int64ObservableCounter("proxyfleet.gateway.request_log.records",
		metric.WithDescription("Request log records by result: sent to FLEET_GATEWAY_LOG, dropped (the queue was full), failed (the stream refused or did not acknowledge it), sampled_out"),
		metric.WithUnit("{record}"))
	if err != nil {
		return err
	}
	_, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		n := l.Counts()
		for result, v := range map[string]int64{"sent": n.Sent, "dropped": n.Dropped, "failed": n.Failed, "sampled_out": n.SampledOut} {
			o.ObserveInt64(c, v, metric.WithAttributes(attribute.String("result", result)))
		}
		return nil
	}, c)
	return err
}

// Sample reports whether rec is recorded: always when it is not a plain
// success (an error, a ban, more than one attempt), otherwise with the
// configured share.
func (l *Logger) Sample(rec *events.GatewayRequest) bool {
	if l == nil {
		return false
	}
	if rec.Outcome != events.RequestOK || rec.Ban != "" || rec.Attempts > 1 || l.cfg.Sample >= 1 {
		return true
	}
	return l.random() < l.cfg.Sample
}

// Log queues rec for publishing without waiting; it returns false, and
// counts the record dropped, when the queue is full.
func (l *Logger) Log(rec *events.GatewayRequest) bool {
	if l == nil {
		return false
	}
	select {
	case l.queue <- rec:
		return true
	default:
		l.dropped.Add(1)
		return false
	}
}

// Run publishes queued records until ctx ends, then publishes what is
// still queued and waits a moment for the stream's acknowledgements.
func (l *Logger) Run(ctx context.Context) error {
	if l == nil {
		return nil
	}
	for {
		select {
		case rec := <-l.queue:
			l.publish(rec)
		case <-ctx.Done():
			for len(l.queue) > 0 { // Run is the queue's one reader
				l.publish(<-l.queue)
			}
			select {
			case <-l.js.PublishAsyncComplete():
			case <-time.After(2 * time.Second):
			}
			return nil
		}
	}
}

func (l *Logger) publish(rec *events.GatewayRequest) {
	b, err := json.Marshal(rec)
	if err != nil {
		l.publishFailed(err)
		return
	}
	// With MaxPending unacknowledged records this waits a moment, then
	// fails: the stream is behind, and the record is lost, not the
	// requests held up.
	if _, err := l.js.PublishAsync(l.subject, b); err != nil {
		l.publishFailed(err)
		return
	}
	l.sent.Add(1)
}

// publishFailed counts a record lost after it left the queue, and warns
// at most once a minute.
func (l *Logger) publishFailed(err error) {
	l.failed.Add(1)
	now := time.Now().UnixNano()
	last := l.lastWarn.Load()
	if now-last < int64(time.Minute) || !l.lastWarn.CompareAndSwap(last, now) {
		return
	}
	hint := ""
	if errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrNoStreamResponse) {
		hint = "; is the stream " + "FLEET_GATEWAY_LOG" + " there (planner bootstrap creates it)?"
	}
	l.log.Warn("request log records lost"+hint, "subject", l.subject, "err", err, "failed_total", l.failed.Load())
}
