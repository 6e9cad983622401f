package projection_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/events/lifecycletest"
)

// logMsg is one message of a generated FLEET_EVENTS log.
type logMsg struct {
	subject string
	msgID   string
	data    []byte
}

// fleetLog returns about n events of a fleet's life, drawn from seed: pools
// applied, re-applied, annotated with conditions and deleted; proxies
// requested (some as replacements), provisioning, running, ready ⇄
// unhealthy, failed, retiring, deleted or abandoned, their events
// interleaved as a busy fleet's are; and the late observations a real log
// holds (a probe after the deletion, a running after retiring). Event times
// advance by a millisecond an event from a fixed instant, so the same seed
// gives the same bytes.
func fleetLog(seed uint64, n, live int) []logMsg {
	r := rand.New(rand.NewPCG(seed, seed^0x5851f42d4c957f2d))
	t0 := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	var out []logMsg
	addFrom := func(source, agg, id, kind, msgID string, data any) {
		env, err := events.NewEnvelope(msgID, source, events.EnvelopeType(agg, kind), id,
			t0.Add(time.Duration(len(out))*time.Millisecond), data)
		if err != nil {
			panic(err)
		}
		body, err := env.MarshalJSON()
		if err != nil {
			panic(err)
		}
		out = append(out, logMsg{subject: events.SubjectOf(source, agg, id, kind), msgID: msgID, data: body})
	}
	add := func(agg, id, kind, msgID string, data any) {
		addFrom(bustest.Source(agg, kind), agg, id, kind, msgID, data)
	}

	pools := make([]string, 3+live/500)
	revs := map[string]int{}
	for i := range pools {
		pools[i] = fmt.Sprintf("pool-%d", i)
	}
	applyPool := func(name string) {
		revs[name]++
		spec := events.PoolSpec{Name: name, Provider: "local", Size: live / len(pools), Port: 3128,
			Auth: &events.ProxyAuth{Username: "u"}, MaxAge: events.Duration(time.Duration(revs[name]) * time.Hour)}
		add(events.AggregatePool, name, events.PoolApplied, fmt.Sprintf("%s.applied.%d", name, revs[name]),
			events.PoolAppliedData{Spec: spec, Revision: revs[name], SecretsDigest: fmt.Sprintf("d%d", revs[name])})
	}
	for _, p := range pools {
		applyPool(p)
	}

	type proxy struct {
		id, pool, state string
		target          string // where it was placed: its agent's target
		step            int    // events so far, the attempt counter of ids
	}
	var (
		alive []*proxy
		ended []*proxy
		made  int
	)
	next := func(p *proxy, kind string, data any) {
		p.step++
		p.state = kind
		source := bustest.Source(events.AggregateProxy, kind)
		if events.WriterOf(source) == events.WriterAgent {
			// The agent of the proxy's target observes it.
			source = events.AgentSource("local", p.target)
		}
		addFrom(source, events.AggregateProxy, p.id, kind, events.ProxyEventID(p.id, kind, uint64(p.step)), data)
	}
	request := func(pool string, replaces *proxy) {
		made++
		p := &proxy{id: fmt.Sprintf("%s-%08x", pool, made), pool: pool, target: fmt.Sprintf("t%d", made%7)}
		d := events.ProxyRequestedData{
			ProxySpec: events.ProxySpec{Pool: pool, Entry: "local", Target: p.target, Instance: events.InstanceName(p.id), Revision: revs[pool], Port: 3128},
			Username:  "u",
		}
		if replaces != nil {
			d.Replaces, d.ReplaceReason = replaces.id, "unhealthy: probe failed"
		}
		next(p, events.ProxyRequested, d)
		alive = append(alive, p)
	}
	end := func(i int) {
		ended = append(ended, alive[i])
		alive[i] = alive[len(alive)-1]
		alive = alive[:len(alive)-1]
	}

	for len(out) < n {
		switch x := r.IntN(1000); {
		case x < 3:
			p := pools[r.IntN(len(pools))]
			add(events.AggregatePool, p, events.PoolCondition, fmt.Sprintf("%s.condition.%d", p, len(out)),
				events.PoolConditionData{Type: events.ConditionReady, Status: []string{events.ConditionTrue, events.ConditionFalse}[r.IntN(2)],
					Reason: events.ReasonNotEnoughReady, Message: fmt.Sprintf("%d of %d ready", r.IntN(live), live)})
			continue
		case x < 4:
			applyPool(pools[r.IntN(len(pools))])
			continue
		case x < 6 && len(ended) > 0:
			// A late observation of an ended proxy: the view ignores it.
			p := ended[r.IntN(len(ended))]
			add(events.AggregateProxy, p.id, events.ProxyUnhealthy, events.ProxyEventID(p.id, events.ProxyUnhealthy, uint64(len(out))),
				events.ProxyUnhealthyData{Reason: "late probe", Streak: 3})
			continue
		}
		if len(alive) < live {
			request(pools[r.IntN(len(pools))], nil)
			continue
		}
		i := r.IntN(len(alive))
		p := alive[i]
		addr := fmt.Sprintf("10.%d.%d.%d:3128", made%200, p.step%250, i%250)
		switch p.state {
		case events.ProxyRequested:
			next(p, events.ProxyProvisioning, events.ProxyProvisioningData{Entry: "local", Target: p.target, Instance: events.InstanceName(p.id), ProviderID: "vm-" + p.id, Attempt: 1})
		case events.ProxyProvisioning:
			if r.IntN(20) == 0 {
				next(p, events.ProxyFailed, events.ProxyFailedData{Class: events.ClassQuota, Reason: "no capacity", Attempt: 1})
				continue
			}
			next(p, events.ProxyRunning, events.ProxyRunningData{Address: addr, ProviderID: "vm-" + p.id, Attempt: 1})
		case events.ProxyRunning:
			next(p, events.ProxyReady, events.ProxyReadyData{Address: addr, LatencyMS: int64(r.IntN(200)), EgressIP: fmt.Sprintf("192.0.2.%d", r.IntN(250))})
		case events.ProxyReady:
			switch y := r.IntN(10); {
			case y < 6:
				next(p, events.ProxyUnhealthy, events.ProxyUnhealthyData{Reason: "connect timeout", Streak: 3 + r.IntN(3)})
			case y < 8:
				request(p.pool, p)
			default:
				next(p, events.ProxyRetiring, events.ProxyRetiringData{Reason: "rotated: max age"})
			}
		case events.ProxyUnhealthy:
			if r.IntN(3) == 0 {
				next(p, events.ProxyRetiring, events.ProxyRetiringData{Reason: "unhealthy: connect timeout"})
				continue
			}
			next(p, events.ProxyReady, events.ProxyReadyData{Address: addr, LatencyMS: int64(r.IntN(200)), EgressIP: "192.0.2.9"})
		case events.ProxyFailed:
			next(p, events.ProxyRetiring, events.ProxyRetiringData{Reason: "replace failed"})
		case events.ProxyRetiring:
			if r.IntN(10) == 0 {
				// A create finishing after the retire decision.
				next(p, events.ProxyRunning, events.ProxyRunningData{Address: addr, Attempt: 2})
				p.state = events.ProxyRetiring
				continue
			}
			if r.IntN(15) == 0 {
				next(p, events.ProxyAbandoned, events.ProxyAbandonedData{Reason: "skip cleanup"})
			} else {
				next(p, events.ProxyDeleted, events.ProxyDeletedData{Attempt: 1})
			}
			end(i)
		}
	}
	if len(pools) > 1 {
		add(events.AggregatePool, pools[len(pools)-1], events.PoolDeleted, pools[len(pools)-1]+".deleted", events.PoolDeletedData{Revision: revs[pools[len(pools)-1]] + 1})
	}
	return out
}

// publishLog appends msgs to FLEET_EVENTS, pipelined, and returns the last
// sequence.
func publishLog(tb testing.TB, ctx context.Context, c *bus.Conn, msgs []logMsg) uint64 {
	tb.Helper()
	const window = 2048
	futs := make([]jetstream.PubAckFuture, 0, window)
	var last uint64
	flush := func() {
		for _, f := range futs {
			select {
			case ack := <-f.Ok():
				last = max(last, ack.Sequence)
			case err := <-f.Err():
				tb.Fatalf("publish %s: %v", f.Msg().Subject, err)
			case <-ctx.Done():
				tb.Fatal(ctx.Err())
			}
		}
		futs = futs[:0]
	}
	for _, m := range msgs {
		msg := nats.NewMsg(m.subject)
		msg.Data = m.data
		f, err := c.JS.PublishMsgAsync(msg, jetstream.WithMsgID(m.msgID))
		if err != nil {
			tb.Fatal(err)
		}
		futs = append(futs, f)
		if len(futs) == window {
			flush()
		}
	}
	flush()
	return last
}

// mixedLog returns a fleet's log of about n events (see fleetLog) with the
// lifecycle's adversarial and random sequences (pkg/events/lifecycletest)
// and messages no view takes (garbage, unknown aggregates, a planner term)
// shuffled in, each source keeping its own order.
func mixedLog(seed uint64, n int) []logMsg {
	r := rand.New(rand.NewPCG(seed, 7))
	t0 := time.Date(2026, 2, 1, 8, 0, 0, 0, time.UTC)
	var odd []logMsg
	add := func(evs []lifecycletest.Event) {
		for _, ev := range evs {
			env, err := events.NewEnvelope(ev.MsgID, ev.Source, events.EnvelopeType(ev.Aggregate, ev.Kind), ev.ID,
				t0.Add(time.Duration(len(odd))*time.Second), ev.Data)
			if err != nil {
				panic(err)
			}
			body, err := env.MarshalJSON()
			if err != nil {
				panic(err)
			}
			odd = append(odd, logMsg{subject: ev.On(), msgID: ev.MsgID, data: body})
		}
	}
	add(lifecycletest.Adversarial("adv"))
	for i := range 6 {
		add(lifecycletest.Sequence(fmt.Sprintf("seq%d", i), seed+uint64(i), 60))
	}
	odd = append(odd,
		logMsg{subject: "fleet.evt.proxy.adv-obsfirst.running", data: []byte(`{not json`)},
		logMsg{subject: "fleet.evt.widget.w1.made", data: []byte(`{"specversion":"1.0","id":"x2","source":"t","type":"proxyfleet.widget.made.v1","time":"2026-01-01T00:00:00Z","data":{}}`)},
		logMsg{subject: events.PlannerTermSubject(), data: []byte(`{"specversion":"1.0","id":"t1","source":"proxyfleet/planner","type":"proxyfleet.planner.term.v1","time":"2026-01-01T00:00:00Z","data":{"term":1,"leader":"a"}}`)},
	)
	fleet := fleetLog(seed, n, n/20)
	out := make([]logMsg, 0, len(fleet)+len(odd))
	for len(fleet) > 0 || len(odd) > 0 {
		if len(odd) == 0 || len(fleet) > 0 && r.IntN(len(fleet)+len(odd)) < len(fleet) {
			out, fleet = append(out, fleet[0]), fleet[1:]
		} else {
			out, odd = append(out, odd[0]), odd[1:]
		}
	}
	return out
}
