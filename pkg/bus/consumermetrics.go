package bus

import (
	"context"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// ConsumerMetricsInterval is how often [FollowConsumer] asks the server for
// a consumer's info by default.
const ConsumerMetricsInterval = 5 * time.Second

// FollowConsumer exports the backlog of the durable consumer name of
// stream as two gauges of meter, until ctx ends:
// proxyfleet_consumer_pending_messages (not yet delivered) and
// proxyfleet_consumer_ack_pending_messages (delivered, not yet
// acknowledged), labelled stream and consumer. A scrape reads the values
// of the last refresh, which asks the server every interval (0 means
// [ConsumerMetricsInterval]), starting at once; a consumer the server does
// not answer for is not reported. Each info refreshed is also handed to
// seen, when not nil. It returns when ctx ends.
func FollowConsumer(ctx context.Context, c *Conn, meter metric.Meter, stream, name string, interval time.Duration, seen func(context.Context, *jetstream.ConsumerInfo)) error {
	if interval <= 0 {
		interval = ConsumerMetricsInterval
	}
	pending, err := meter.Int64ObservableGauge("proxyfleet_consumer_pending_messages",
		metric.WithDescription("Messages of the stream the durable consumer has not delivered yet."))
	if err != nil {
		return err
	}
	ackPending, err := meter.Int64ObservableGauge("proxyfleet_consumer_ack_pending_messages",
		metric.WithDescription("Messages the durable consumer delivered that are not acknowledged yet."))
	if err != nil {
		return err
	}
	var (
		mu   sync.Mutex
		last *jetstream.ConsumerInfo
	)
	attrs := metric.WithAttributes(attribute.String("stream", stream), attribute.String("consumer", name))
	reg, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		mu.Lock()
		defer mu.Unlock()
		if last != nil {
			o.ObserveInt64(pending, int64(last.NumPending), attrs)
			o.ObserveInt64(ackPending, int64(last.NumAckPending), attrs)
		}
		return nil
	}, pending, ackPending)
	if err != nil {
		return err
	}
	defer func() { _ = reg.Unregister() }()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		ictx, cancel := context.WithTimeout(ctx, interval)
		cons, err := c.JS.Consumer(ictx, stream, name)
		var info *jetstream.ConsumerInfo
		if err == nil {
			info = cons.CachedInfo()
			if seen != nil {
				seen(ictx, info)
			}
		}
		cancel()
		mu.Lock()
		last = info
		mu.Unlock()
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
