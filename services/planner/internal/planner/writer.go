package planner

import (
	"context"
	"errors"
	"fmt"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// The one writer.
//
// Every event the planner appends and every command it publishes goes
// through a [flight]: its decisions are appended in atomic batches fenced
// by a planner term, each expecting its aggregate's last sequence, and a
// decision's command is published only once the decision is stored. There
// are two ways in:
//
//   - Decisions (the reconciler's rounds, garbage collection, autoscaling,
//     and the operator's recycle, report-ban, proxy.delete and
//     instance.delete) are taken by the leader alone, on its reconciler
//     goroutine, fenced by the term it leads. The deciding endpoints are a
//     service instance the leader adds when its term begins and stops when
//     it ends ([apiserver.Leader]), so NATS routes those requests to
//     the leader and a follower never takes one; the leader runs each as a
//     job between two rounds ([Planner.asLeader]), so an operator's
//     decision and the reconciler's never race on one pool's view (the pool
//     cannot get two replacements for one proxy), and a leader paused past
//     its lease lands nothing when it resumes: its term is refused.
//     Forwarding from followers was the alternative; it adds a hop, a
//     subject and its permissions for nothing the routing does not give.
//   - Intents (pool.apply, pool.delete) record what the operator wants, not
//     a decision from the fleet's state, and any replica takes them, so the
//     API works while leadership moves. They are fenced by the latest term
//     in the log ([Planner.appendIntent]): a replica that has not read a
//     newer term is refused and reads it again.

// leaderJob is one operator decision the leader takes between two rounds.
type leaderJob struct {
	ctx  context.Context
	run  func(ctx context.Context, rc *reconciler, f *flight)
	done chan struct{}
}

// errNotLeading answers a deciding request that reached a replica whose
// term ended meanwhile.
func errNotLeading() *api.APIError {
	return api.Unavailable("this planner replica no longer leads; retry (the next leader answers)")
}

// asLeader runs fn on the leader's reconciler goroutine, between rounds,
// with a flight of the leader's term, and returns once the flight has
// settled: every unit fn decided has its verdict. It refuses when this
// replica does not lead or stops leading before fn ran.
func (p *Planner) asLeader(ctx context.Context, fn func(ctx context.Context, rc *reconciler, f *flight)) *api.APIError {
	l := p.lease.leading.Load()
	if l == nil {
		return errNotLeading()
	}
	j := leaderJob{ctx: ctx, run: fn, done: make(chan struct{})}
	select {
	case l.jobs <- j:
	case <-l.ended:
		return errNotLeading()
	case <-ctx.Done():
		return api.Internal("the leader did not take the request in time; retry")
	}
	select {
	case <-j.done:
		return nil
	case <-ctx.Done():
		// The job still runs to its end on the reconciler.
		return api.Internal("the decision did not settle in time; get the proxy to see whether it was recorded")
	}
}

// runJob runs one job on the reconciler goroutine: once the projection
// holds this leader's own last decision, so the job decides from it.
func (rc *reconciler) runJob(ctx context.Context, j leaderJob) {
	defer close(j.done)
	jctx, cancel := context.WithCancel(j.ctx)
	defer cancel()
	stop := context.AfterFunc(ctx, cancel) // the term ends: so does the job
	defer stop()
	if err := rc.waitSeq(jctx, rc.ownSeq); err != nil {
		return
	}
	f := rc.flight(jctx)
	j.run(jctx, rc, f)
	f.wait()
}

// appendIntent appends one operator intent about pool (its data of type
// typ, with msgID), expecting the pool's last sequence, fenced by the
// latest planner term in the log, and returns the event's sequence. A
// term opened between the read and the append is read again.
func (p *Planner) appendIntent(ctx context.Context, pool, typ, msgID string, data any, expect uint64, logArgs []any) (uint64, error) {
	for range 3 {
		term, err := p.store.CurrentTerm(ctx)
		if err != nil {
			return 0, fmt.Errorf("read the current planner term: %w", err)
		}
		f := p.newFlight(ctx)
		f.term = &bus.Term{}
		if term != nil {
			f.term = term
		}
		ctx, span := p.startWork(ctx, "planner."+typ, 0)
		u := f.decide(ctx, span, pool, events.AggregatePool, pool, &bus.Expect{Seq: expect},
			[]bus.Decision{{Type: typ, MsgID: msgID, Data: data}}, logArgs, nil)
		f.wait()
		if errors.Is(u.err, bus.ErrFenced) {
			continue
		}
		return u.seq, u.err
	}
	return 0, errors.New("planner terms keep opening; retry")
}
