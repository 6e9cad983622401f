package projection_test

import (
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/health/internal/projection"
)

// TestConsumerOfEarlierReleasesIsUpdated: a consumer as earlier releases
// created it (one event in flight, no priority group) is updated in place,
// keeping its position, and the projector carries on from there.
func TestConsumerOfEarlierReleasesIsUpdated(t *testing.T) {
	e := open(t)
	s1 := e.append("p1", events.ProxyRequested, requested("demo"))
	if _, err := e.conn.JS.CreateOrUpdateConsumer(e.ctx, bus.EventsStream, jetstream.ConsumerConfig{
		Durable: projection.ConsumerName, FilterSubject: events.EventsAll, DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30e9, MaxAckPending: 1,
	}); err != nil {
		t.Fatal(err)
	}
	// The earlier projector applied and acknowledged the first event.
	cons, err := e.conn.JS.Consumer(e.ctx, bus.EventsStream, projection.ConsumerName)
	if err != nil {
		t.Fatal(err)
	}
	m, err := cons.Next()
	if err != nil {
		t.Fatal(err)
	}
	if err := projection.New(e.conn, nil, nil).Apply(e.ctx, s1, m.Subject(), m.Data()); err != nil {
		t.Fatal(err)
	}
	if err := m.DoubleAck(e.ctx); err != nil {
		t.Fatal(err)
	}

	s2 := e.append("p1", events.ProxyProvisioning, events.ProxyProvisioningData{Attempt: 1})
	updated, err := projection.EnsureConsumer(e.ctx, e.conn)
	if err != nil {
		t.Fatalf("update the consumer: %v", err)
	}
	if floor := updated.CachedInfo().AckFloor.Stream; floor != s1 {
		t.Fatalf("updated consumer acknowledged up to %d; want %d", floor, s1)
	}
	e.run()
	if got := e.waitProxy("p1", s2); got.State != events.ProxyProvisioning {
		t.Fatalf("p1 = %+v; want provisioning", got)
	}
	e.caughtUp()
	info, err := cons.Info(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	if c := info.Config; c.MaxAckPending < 2 || c.PriorityPolicy != jetstream.PriorityPolicyPinned || len(c.PriorityGroups) != 1 {
		t.Fatalf("consumer config after the update: MaxAckPending %d, priority %v %v", c.MaxAckPending, c.PriorityPolicy, c.PriorityGroups)
	}
}
