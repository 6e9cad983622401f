package projection_test

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/health/internal/projection"
)

// TestUnreadablePoolDeletionDeletesNothing: a pool.deleted event whose
// data does not decode is skipped, as the planner skips it, instead of
// removing the pool from fleet-pools while the planner keeps it.
func TestUnreadablePoolDeletionDeletesNothing(t *testing.T) {
	e := start(t)
	spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 1, Port: 3128}
	e.append("demo", events.PoolApplied, events.PoolAppliedData{Spec: spec, Revision: 1})
	if _, err := e.conn.JS.Publish(e.ctx, events.EventSubject(events.AggregatePool, "demo", events.PoolDeleted),
		[]byte(`{"specversion":"1.0","id":"bad-delete","source":"proxyfleet/planner","type":"proxyfleet.pool.deleted.v1","time":"2026-01-01T00:00:00Z","data":{"revision":"two"}}`)); err != nil {
		t.Fatal(err)
	}
	after := e.append("demo", events.PoolCondition, events.PoolConditionData{Type: events.ConditionPlaced, Status: events.ConditionTrue, Reason: events.ReasonPlaced})
	var got projection.Pool
	e.eventually("the condition after the unreadable deletion", func() bool { return e.get(bus.BucketPools, "demo", &got) && got.Seq == after })
	if got.Revision != 1 {
		t.Errorf("pool after an unreadable deletion: revision %d, want 1", got.Revision)
	}
}

// TestExpiringPoolDeletionDeletesNothing: a well-formed pool.deleted that
// carries a Nats-TTL (which any writer may set, since the stream allows
// TTLs for the planner's fences) is not history: health skips it, as the
// planner does, instead of removing a pool that a rebuild after the event
// expired would show again.
func TestExpiringPoolDeletionDeletesNothing(t *testing.T) {
	e := start(t)
	spec := events.PoolSpec{Name: "demo", Provider: "local", Size: 1, Port: 3128}
	e.append("demo", events.PoolApplied, events.PoolAppliedData{Spec: spec, Revision: 1})
	env, err := events.NewEnvelope("demo.deleted.1", events.SourcePlanner, events.EnvelopeType(events.AggregatePool, events.PoolDeleted), "demo", time.Now(),
		events.PoolDeletedData{Revision: 1})
	if err != nil {
		t.Fatal(err)
	}
	body, _ := env.MarshalJSON()
	msg := nats.NewMsg(events.EventSubject(events.AggregatePool, "demo", events.PoolDeleted))
	msg.Data = body
	msg.Header.Set(jetstream.MsgTTLHeader, "1h")
	if _, err := e.conn.JS.PublishMsg(e.ctx, msg); err != nil {
		t.Fatal(err)
	}
	after := e.append("demo", events.PoolCondition, events.PoolConditionData{Type: events.ConditionPlaced, Status: events.ConditionTrue, Reason: events.ReasonPlaced})
	var got projection.Pool
	e.eventually("the condition after the expiring deletion", func() bool { return e.get(bus.BucketPools, "demo", &got) && got.Seq == after })
	if got.Revision != 1 {
		t.Errorf("pool after a deletion that may expire: revision %d, want 1", got.Revision)
	}
}
