package agent_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
)

// BenchmarkCommandToObservation measures one create command's round trip
// through the agent runtime — publish, consume, read the proxy's last event,
// publish provisioning, run a driver that answers at once, publish running,
// acknowledge — until the running event is seen. The baseline, measured in
// the same run on the same server, is the bare JetStream round trip the
// runtime is built on: publish to a work-queue stream, consume, acknowledge,
// and answer with one message. `make bench` prints the ratio.
func BenchmarkCommandToObservation(b *testing.B) {
	ctx := context.Background()
	c := bustest.Start(b)
	// The benchmark function runs more than once; proxy ids must not repeat,
	// or the runtime would rightly find those proxies already running.
	next := 0

	b.Run("baseline", func(b *testing.B) {
		if _, err := c.JS.CreateStream(ctx, jetstream.StreamConfig{Name: "BENCH", Subjects: []string{"bench.>"}, Retention: jetstream.WorkQueuePolicy}); err != nil {
			b.Fatal(err)
		}
		cons, err := c.JS.CreateOrUpdateConsumer(ctx, "BENCH", jetstream.ConsumerConfig{Durable: "w", AckPolicy: jetstream.AckExplicitPolicy})
		if err != nil {
			b.Fatal(err)
		}
		cc, err := cons.Consume(func(m jetstream.Msg) {
			_ = m.DoubleAck(ctx)
			_ = c.NC.Publish("benchdone."+m.Subject()[len("bench.cmd."):], nil)
		})
		if err != nil {
			b.Fatal(err)
		}
		defer cc.Stop()
		done := make(chan *nats.Msg, 1)
		sub, _ := c.NC.ChanSubscribe("benchdone.>", done)
		defer sub.Unsubscribe()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			if _, err := c.JS.Publish(ctx, fmt.Sprintf("bench.cmd.%d", i), []byte("{}")); err != nil {
				b.Fatal(err)
			}
			wait(b, done)
		}
	})

	b.Run("runtime", func(b *testing.B) {
		rt, err := agent.New(c, newMemDriver(), agent.Config{Info: agent.Info{Entry: "bench", Target: "t1", Type: "memory"}}, nil, nil)
		if err != nil {
			b.Fatal(err)
		}
		_, stop := agenttest.Serve(b, rt.Run)
		defer func() { _ = stop() }()
		done := make(chan *nats.Msg, 1)
		sub, _ := c.NC.ChanSubscribe("fleet.evt.proxy.*.running.>", done)
		defer sub.Unsubscribe()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			next++
			id := fmt.Sprintf("bench-%d", next)
			cmd := events.CreateCommand{ProxyID: id, ProxySpec: events.ProxySpec{Pool: "p", Entry: "bench", Target: "t1", Instance: events.InstanceName(id), Port: 3128}, Attempt: 1}
			if _, err := bus.PublishCreate(ctx, c, "bench", cmd, 0); err != nil {
				b.Fatal(err)
			}
			wait(b, done)
		}
	})
}

func wait(b *testing.B, ch chan *nats.Msg) {
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		b.Fatal("no answer within 10s")
	}
}
