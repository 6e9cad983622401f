// Package tail follows the event log (FLEET_EVENTS) and keeps its last
// entries as sentences an operator reads: what was decided or observed,
// about which pool and proxy, and why ("replaced because recycled by
// operator", "retiring because unhealthy: …", "scaled to 5 from 3:
// autoscale: …"). The console's events page shows them, filtered by pool
// and proxy.
package tail

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// Entry is one event of the tail.
type Entry struct {
	Seq  uint64
	Time time.Time
	// Pool and Proxy are what the event is about ("" when it is about no
	// proxy). For a replacement, Proxy is the proxy replaced and
	// Replacement the one requested in its place.
	Pool, Proxy, Replacement string
	// Type is the event's type, or "replaced" for the request of a
	// replacement.
	Type string
	// Text says what happened and why.
	Text string
}

// Tail holds the last entries of the event log. It is safe for concurrent
// use.
type Tail struct {
	size int
	// poolOf names the pool of a proxy whose requested event is older than
	// the tail (the views know it).
	poolOf func(id string) string

	mu    sync.RWMutex
	ring  []Entry // oldest first
	pools map[string]string
	gen   uint64
}

// New returns a tail of at most size entries (1000 when 0). poolOf, if
// not nil, names the pool of a proxy the tail has not seen requested.
func New(size int, poolOf func(id string) string) *Tail {
	if size <= 0 {
		size = 1000
	}
	return &Tail{size: size, poolOf: poolOf, pools: map[string]string{}}
}

// Gen changes whenever an entry arrives.
func (t *Tail) Gen() uint64 {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.gen
}

// Last returns at most n entries, newest first, of pool and proxy ("":
// any). An entry matches proxy when it is about that proxy or its
// replacement.
func (t *Tail) Last(n int, pool, proxy string) []Entry {
	t.mu.RLock()
	defer t.mu.RUnlock()
	out := make([]Entry, 0, min(n, len(t.ring)))
	for i := len(t.ring) - 1; i >= 0 && len(out) < n; i-- {
		e := t.ring[i]
		if pool != "" && e.Pool != pool {
			continue
		}
		if proxy != "" && e.Proxy != proxy && e.Replacement != proxy {
			continue
		}
		out = append(out, e)
	}
	return out
}

// Add records one event of the log.
func (t *Tail) Add(ev bus.Event) {
	if ev.Unreadable != nil || ev.Aggregate == events.AggregatePlanner {
		return
	}
	t.mu.Lock()
	e, ok := t.describe(ev)
	if !ok {
		t.mu.Unlock()
		return
	}
	if len(t.ring) >= t.size {
		copy(t.ring, t.ring[1:])
		t.ring = t.ring[:len(t.ring)-1]
	}
	t.ring = append(t.ring, e)
	t.gen++
	t.mu.Unlock()
}

// maxPools bounds the proxy-to-pool memory of the tail: it is dropped
// whole past it and filled again from the events and the views.
const maxPools = 200_000

// describe turns ev into an entry; called with t.mu held.
func (t *Tail) describe(ev bus.Event) (Entry, bool) {
	e := Entry{Seq: ev.Seq, Time: ev.Time, Type: ev.Kind}
	switch ev.Aggregate {
	case events.AggregatePool:
		e.Pool = ev.ID
		e.Text = t.poolText(ev)
		return e, true
	case events.AggregateProxy:
	default:
		return e, false
	}
	e.Proxy = ev.ID
	e.Pool = t.pools[ev.ID]
	if e.Pool == "" && t.poolOf != nil {
		e.Pool = t.poolOf(ev.ID)
	}
	where := ""
	if !ev.By.IsZero() {
		where = " (" + ev.By.String() + ")"
	}
	switch ev.Kind {
	case events.ProxyRequested:
		var d events.ProxyRequestedData
		if decode(ev, &d) != nil {
			return e, false
		}
		if len(t.pools) >= maxPools {
			t.pools = map[string]string{}
		}
		t.pools[ev.ID] = d.Pool
		e.Pool = d.Pool
		on := d.Entry + "/" + d.Target
		if d.Replaces != "" {
			e.Type, e.Proxy, e.Replacement = "replaced", d.Replaces, ev.ID
			e.Text = fmt.Sprintf("replaced because %s: %s requested on %s to replace %s", orUnknown(d.ReplaceReason), ev.ID, on, d.Replaces)
		} else {
			e.Text = fmt.Sprintf("requested on %s", on)
		}
	case events.ProxyProvisioning:
		e.Text = "provisioning" + where
	case events.ProxyRunning:
		var d events.ProxyRunningData
		_ = decode(ev, &d)
		e.Text = "running at " + orUnknown(d.Address) + where
	case events.ProxyReady:
		var d events.ProxyReadyData
		_ = decode(ev, &d)
		e.Text = fmt.Sprintf("ready: a probe went through in %d ms", d.LatencyMS)
		if d.EgressIP != "" {
			e.Text += ", egress " + d.EgressIP
		}
	case events.ProxyUnhealthy:
		var d events.ProxyUnhealthyData
		_ = decode(ev, &d)
		e.Text = fmt.Sprintf("unhealthy after %d failed probes: %s", d.Streak, orUnknown(d.Reason))
	case events.ProxyFailed:
		var d events.ProxyFailedData
		_ = decode(ev, &d)
		e.Text = fmt.Sprintf("failed (%s)%s: %s", orUnknown(d.Class), where, orUnknown(d.Reason))
	case events.ProxyRetiring:
		var d events.ProxyRetiringData
		_ = decode(ev, &d)
		e.Text = "retiring because " + orUnknown(d.Reason)
		if d.SkipCleanup {
			e.Text += " (its instance is left in place)"
		}
	case events.ProxyDisabled:
		var d events.ProxyDisabledData
		_ = decode(ev, &d)
		e.Text = fmt.Sprintf("disabled until %s because %s", d.Until.UTC().Format(time.TimeOnly), orUnknown(d.Reason))
	case events.ProxyDeleted:
		e.Text = "deleted" + where
		delete(t.pools, ev.ID)
	case events.ProxyAbandoned:
		var d events.ProxyAbandonedData
		_ = decode(ev, &d)
		e.Text = "abandoned: " + orUnknown(d.Reason)
		delete(t.pools, ev.ID)
	default:
		e.Text = ev.Kind + where
	}
	return e, true
}

func (t *Tail) poolText(ev bus.Event) string {
	switch ev.Kind {
	case events.PoolApplied:
		var d events.PoolAppliedData
		if decode(ev, &d) != nil {
			return "applied"
		}
		return fmt.Sprintf("applied: revision %d, size %d", d.Revision, d.Spec.Size)
	case events.PoolDeleted:
		return "deleted: its proxies are retired"
	case events.PoolScaled:
		var d events.PoolScaledData
		_ = decode(ev, &d)
		return fmt.Sprintf("scaled to %d from %d: %s", d.Size, d.Previous, orUnknown(d.Reason))
	case events.PoolCondition:
		var d events.PoolConditionData
		_ = decode(ev, &d)
		s := fmt.Sprintf("%s=%s %s", d.Type, d.Status, d.Reason)
		if d.Message != "" {
			s += ": " + d.Message
		}
		return s
	}
	return ev.Kind
}

// decode reads an event's data for display: no validation, which is the
// writers' and the projections' business (an event the tail cannot read
// still shows, with less said).
func decode(ev bus.Event, out any) error { return json.Unmarshal(ev.Data, out) }

func orUnknown(s string) string {
	if strings.TrimSpace(s) == "" {
		return "(no reason given)"
	}
	return s
}

// Follower feeds a [Tail] from the event log.
type Follower struct {
	conn *bus.Conn
	tail *Tail
	// back is how many events before the end the tail starts from.
	back uint64
	log  *slog.Logger
}

// NewFollower returns a follower of conn's event log into tail, starting
// back events before the end of the log.
func NewFollower(conn *bus.Conn, tail *Tail, back uint64, log *slog.Logger) *Follower {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Follower{conn: conn, tail: tail, back: back, log: log}
}

// Run follows the log until ctx ends, again after a pause when the read
// fails, from the event after the last one it saw.
func (f *Follower) Run(ctx context.Context) error {
	store := bus.NewEventStore(f.conn, "console", f.log)
	var from uint64
	pause := time.Second
	for ctx.Err() == nil {
		if from == 0 {
			from = f.start(ctx)
		}
		err := store.Follow(ctx, from, func(ev bus.Event) error {
			f.tail.Add(ev)
			from = ev.Seq + 1
			return nil
		}, nil)
		if ctx.Err() != nil {
			return nil
		}
		f.log.Warn("reading the event log stopped; reading it again", "err", err, "from", from, "retry_in", pause.String())
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(pause):
		}
		pause = min(2*pause, 30*time.Second)
	}
	return nil
}

// start is the sequence the tail begins at: back events before the end.
func (f *Follower) start(ctx context.Context) uint64 {
	s, err := f.conn.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		return 1
	}
	info, err := s.Info(ctx)
	if err != nil || info.State.LastSeq <= f.back {
		return 1
	}
	return info.State.LastSeq - f.back + 1
}
