package projection_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/services/health/internal/projection"
)

// TestStolenDeliveriesAreDeliveredAgainAtOnce steals deliveries from the
// live projector as a pull request it no longer reads would: the pull
// request of an iterator it stopped, which the server has not dropped
// yet, or one lost in a reconnection. While the projector holds the pin,
// another connection sends pull requests carrying that pin to an inbox
// nobody acknowledges from, as the log is appended; then it goes away.
// The server hands those requests every other delivery, so the projector
// sees newer events of a key without the older ones taken. It must notice
// the gap and have them delivered again at once: well before ackWait
// (after which they would come back, behind newer events of their keys,
// and be skipped as already applied), the consumer must have acknowledged
// the whole log, and the views must be those a rebuild gives.
func TestStolenDeliveriesAreDeliveredAgainAtOnce(t *testing.T) {
	const (
		warm   = 300 // events applied before the stealing starts
		chunk  = 300 // events appended per stolen pull request
		tail   = 300 // events appended once the thief has gone
		batch  = 5   // deliveries one stolen pull request asks for
		within = 20 * time.Second
	)
	if within >= bus.HealthProjectionAckWait {
		t.Fatalf("the bound %v must be below ackWait %v: a redelivery after ackWait is what the test rules out", within, bus.HealthProjectionAckWait)
	}
	e := open(t)
	var gaps atomic.Int64
	e.runWith(projection.New(e.conn, slog.New(&gapCounter{n: &gaps}), nil))

	msgs := mixedLog(17, 3000)
	publishLog(t, e.ctx, e.conn, msgs[:warm])
	e.caughtUp()
	cons, err := e.conn.JS.Consumer(e.ctx, bus.EventsStream, projection.ConsumerName)
	if err != nil {
		t.Fatal(err)
	}
	info, err := cons.Info(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(info.PriorityGroups) != 1 || info.PriorityGroups[0].PinnedClientID == "" {
		t.Fatalf("no projector holds the consumer after applying %d events: priority groups %+v", warm, info.PriorityGroups)
	}
	pin := info.PriorityGroups[0].PinnedClientID

	thief := bustest.Dial(t, e.conn)
	inbox := thief.NC.NewRespInbox()
	sub, err := thief.NC.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	next := fmt.Sprintf("$JS.API.CONSUMER.MSG.NEXT.%s.%s", bus.EventsStream, projection.ConsumerName)
	req, err := json.Marshal(struct {
		Batch   int           `json:"batch"`
		Expires time.Duration `json:"expires"`
		Group   string        `json:"group"`
		ID      string        `json:"id"`
	}{batch, within, projection.PriorityGroup, pin})
	if err != nil {
		t.Fatal(err)
	}
	var stolen []uint64 // stream sequences of the deliveries taken
	take := func() {
		t.Helper()
		for {
			m, err := sub.NextMsg(50 * time.Millisecond)
			if errors.Is(err, nats.ErrTimeout) {
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if status := m.Header.Get("Status"); status != "" {
				// 408 and 409 end a request; 423 means the pin moved and
				// the requests take nothing.
				if status == "423" {
					t.Fatalf("a stolen pull request was refused: %s %s; the pin %s moved", status, m.Header.Get("Description"), pin)
				}
				continue
			}
			md, err := m.Metadata()
			if err != nil {
				t.Fatalf("stolen message on %s: %v", m.Subject, err)
			}
			stolen = append(stolen, md.Sequence.Stream)
		}
	}

	// Each pull request is sent before the events it takes are appended,
	// and it is answered, in turn with the projector's, from the next
	// delivery on.
	for i := warm; i < len(msgs)-tail; i += chunk {
		if err := thief.NC.PublishRequest(next, inbox, req); err != nil {
			t.Fatal(err)
		}
		if err := thief.NC.Flush(); err != nil {
			t.Fatal(err)
		}
		publishLog(t, e.ctx, e.conn, msgs[i:min(i+chunk, len(msgs)-tail)])
		take()
	}
	// The thief goes away: the server drops its requests, and the rest of
	// the log goes to the projector alone, which so sees the gaps.
	if err := sub.Unsubscribe(); err != nil {
		t.Fatal(err)
	}
	if err := thief.NC.Flush(); err != nil {
		t.Fatal(err)
	}
	if len(stolen) == 0 {
		t.Fatal("the stolen pull requests took no delivery: the test proves nothing")
	}
	last := publishLog(t, e.ctx, e.conn, msgs[len(msgs)-tail:])
	t.Logf("stole %d deliveries (first at stream sequence %d); log ends at %d", len(stolen), stolen[0], last)

	began := time.Now()
	deadline := began.Add(within)
	for {
		floor, pending, err := ackState(e.ctx, e)
		if err == nil && floor >= last && pending == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%v after the last append the consumer acknowledged up to %d of %d, %d pending (err %v): the deliveries taken by the stale pull requests were not delivered again before ackWait",
				within, floor, last, pending, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("caught up %v after the last append; the projector reported %d gaps", time.Since(began).Round(time.Millisecond), gaps.Load())
	live := e.dump()
	checkVariety(t, live)
	e.stop()

	if err := projection.Replay(e.ctx, e.conn, nil); err != nil {
		t.Fatal(err)
	}
	rebuilt := e.dump()
	if len(live) != len(rebuilt) {
		t.Errorf("the live views hold %d keys; a rebuild %d", len(live), len(rebuilt))
	}
	diffDumps(t, live, rebuilt)
}

// runWith starts p; stop ends it and waits for it.
func (e *env) runWith(p *projection.Projector) {
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	e.stop = func() {
		cancel()
		if err := <-done; err != nil {
			e.t.Errorf("projector: %v", err)
		}
		e.stop = func() {}
	}
}

// ackState returns the projection consumer's acknowledgement floor (a
// stream sequence) and how many deliveries await an acknowledgement.
func ackState(ctx context.Context, e *env) (floor uint64, pending int, err error) {
	cons, err := e.conn.JS.Consumer(ctx, bus.EventsStream, projection.ConsumerName)
	if err != nil {
		return 0, 0, err
	}
	ci, err := cons.Info(ctx)
	if err != nil {
		return 0, 0, err
	}
	return ci.AckFloor.Stream, ci.NumAckPending, nil
}

// gapCounter counts the projector's warnings about gaps in its deliveries
// (those that carry the delivery sequence wanted), for the test's log.
type gapCounter struct{ n *atomic.Int64 }

func (h *gapCounter) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }

func (h *gapCounter) Handle(_ context.Context, r slog.Record) error {
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "want_delivery" {
			h.n.Add(1)
			return false
		}
		return true
	})
	return nil
}

func (h *gapCounter) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *gapCounter) WithGroup(string) slog.Handler      { return h }

// TestStoppedPullIsForgottenAtOnce: before a reset, a projector stops
// pulling and waits until the server has dropped its pull requests. That
// wait must end as soon as its unsubscribe has reached the server, not at
// its bound: the projection stands still meanwhile, after every gap.
func TestStoppedPullIsForgottenAtOnce(t *testing.T) {
	e := open(t)
	p := projection.New(e.conn, nil, nil)
	bound := projection.StopWait / 2
	for i := range 30 {
		began := time.Now()
		if err := p.PullAndForget(e.ctx); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(began); took >= bound {
			t.Fatalf("pull %d: stopping and waiting for the server to drop the pull requests took %v; want well under %v", i, took, projection.StopWait)
		}
	}
}
