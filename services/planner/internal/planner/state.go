package planner

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"log/slog"
	"sort"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/services/planner/internal/decide"
)

// Proxy is the planner's view of one proxy aggregate, folded from its
// events: what the rules read ([decide.Proxy]: the shared
// [events.ProxyView] that fleet.api.proxy.get answers and fleet-proxies
// holds, with the planner's bookkeeping) and what only effects need.
type Proxy struct {
	decide.Proxy

	// traceparent is the W3C trace context of the requested event.
	traceparent string
	// requested is the decision that created the proxy, replayed into a
	// re-published create command.
	requested events.ProxyRequestedData
}

// Pool is the planner's view of one pool aggregate: what the rules read
// ([decide.Pool]) and the projection's bookkeeping.
type Pool struct {
	decide.Pool
	SecretsDigest string `json:"-"`

	// shape is the instance-shaping part of the applied spec.
	shape string
	// traceparent is the trace context of the pool's last request (its
	// last applied or deleted event): the reconciler's first round after
	// it continues that trace, later work links to it (see tracing.go).
	// traceSeq is that event's sequence.
	traceparent string
	traceSeq    uint64
	// counts is the number of member proxies per state.
	counts map[string]int
	// members holds the pool's proxies that are not terminal.
	members map[string]*Proxy
	// onTarget counts the pool's active proxies per "<entry>.<target>".
	onTarget map[string]int
}

// shapeOf returns the part of a pool spec that shapes its instances: the
// provider, image, profile, port, auth username, the digest of the
// secrets (user-data and password) and the egress allowance. A proxy built
// from another shape is outdated; size, targets and maxAge do not shape an
// instance.
func shapeOf(spec events.PoolSpec, secretsDigest string) string {
	user := ""
	if spec.Auth != nil {
		user = spec.Auth.Username
	}
	parts := []any{spec.Provider, spec.Image, spec.Profile, spec.Port, user, secretsDigest}
	if spec.Egress != nil {
		// Only pools with an allowance carry it, so the shape of every
		// other pool is what it was before the field existed.
		parts = append(parts, spec.Egress)
	}
	b, _ := json.Marshal(parts)
	return string(b)
}

// state is the projection of FLEET_EVENTS. Applying one event costs O(1).
// It is not safe for concurrent use; the [Planner] guards it with its mutex.
type state struct {
	log *slog.Logger
	// seq is the sequence of the last event applied: the state is the
	// fold of FLEET_EVENTS up to it.
	seq uint64
	// anchor is the last applied event that stays in the stream (fence
	// messages expire): a snapshot names it, so a load can tell whether
	// the stream is still the one the snapshot was taken from.
	anchor anchor
	pools  map[string]*Pool
	// proxies holds the live proxies and the last keepFinished finished
	// (deleted or abandoned) ones; older finished proxies leave memory
	// (see [state.finish]).
	proxies map[string]*Proxy
	// finished lists the finished proxies still in proxies, in the order
	// they finished; keepFinished bounds it.
	finished     fifo
	keepFinished int
	// abandoned holds the id of every proxy ever abandoned, in memory or
	// not: the garbage collector never touches their instances.
	abandoned map[string]struct{}
	// targets maps an entry to the targets events named for it (a pool's
	// provider adds the entry with no target).
	targets map[string]map[string]bool
	// avoid holds, per "<entry>.<target>", the last failure that keeps new
	// proxies off a target for a while: quota, or a create stuck for
	// MaxCreateAttempts attempts.
	avoid map[string]decide.Avoidance
	// onTarget counts the active proxies of every pool per
	// "<entry>.<target>": placement's view of each target's load, kept as
	// events arrive so a round need not count the fleet.
	onTarget map[string]int
	// dirty names the pools an event touched since the reconciler last
	// took the set: the pools its next round looks at (see
	// [Planner.reconcile]). It is bookkeeping of this replica, not part of
	// the fold: a snapshot does not carry it.
	dirty map[string]struct{}
	// rejects reports events that break the event contract.
	rejects *bus.Rejects
}

// defaultKeepFinished is how many finished proxies stay in memory unless
// [Config.KeepFinished] says otherwise.
const defaultKeepFinished = 1000

// newState returns an empty state keeping the last keep finished proxies
// in memory.
func newState(log *slog.Logger, keep int) *state {
	return &state{
		log:          log,
		pools:        map[string]*Pool{},
		proxies:      map[string]*Proxy{},
		keepFinished: max(keep, 0),
		abandoned:    map[string]struct{}{},
		targets:      map[string]map[string]bool{},
		avoid:        map[string]decide.Avoidance{},
		onTarget:     map[string]int{},
		dirty:        map[string]struct{}{},
		rejects:      bus.NewRejects(log, 0),
	}
}

// fifo is a queue of proxy ids.
type fifo struct {
	ids  []string
	head int
}

func (q *fifo) len() int { return len(q.ids) - q.head }

func (q *fifo) push(id string) { q.ids = append(q.ids, id) }

func (q *fifo) pop() string {
	id := q.ids[q.head]
	q.ids[q.head] = ""
	q.head++
	// Compact once the consumed head is most of the slice.
	if q.head > 64 && q.head*2 >= len(q.ids) {
		q.ids = append(q.ids[:0:0], q.ids[q.head:]...)
		q.head = 0
	}
	return id
}

// list returns the ids in order.
func (q *fifo) list() []string { return append([]string(nil), q.ids[q.head:]...) }

// finish records that proxy x reached a terminal state. The state keeps
// the last keepFinished finished proxies, so proxy.get answers about a
// recently finished proxy from memory (older ones are folded from the log
// on request, see [Planner.lookupProxy]); the ids of abandoned proxies
// stay for good, for the garbage collector. Nothing else needs a finished
// proxy: decisions are taken on live proxies only, a late event for a
// finished proxy changes nothing (terminal states absorb every event, and
// an unknown proxy is created only by a requested event, which the
// planner appends expecting the aggregate to be empty), and the garbage
// collector treats a deleted proxy and an unknown one alike.
func (s *state) finish(x *Proxy) {
	if x.State == events.ProxyAbandoned {
		s.abandoned[x.ID] = struct{}{}
	}
	s.finished.push(x.ID)
	s.trimFinished()
}

// trimFinished drops the oldest finished proxies beyond keepFinished.
func (s *state) trimFinished() {
	for s.finished.len() > s.keepFinished {
		delete(s.proxies, s.finished.pop())
	}
}

// keepsInstance reports whether the instance of proxy id must be left
// alone by the garbage collector: its proxy is live (or being retired), or
// was abandoned on purpose.
func (s *state) keepsInstance(id string) bool {
	if _, ok := s.abandoned[id]; ok {
		return true
	}
	x := s.proxies[id]
	return x != nil && !events.IsTerminal(x.State)
}

func (s *state) noteTarget(entry, target string) {
	m := s.targets[entry]
	if m == nil {
		m = map[string]bool{}
		s.targets[entry] = m
	}
	if target != "" {
		m[target] = true
	}
}

// pool returns the pool named name, creating an empty, deleted placeholder
// when an event names a pool the log never applied: its proxies are then
// retired.
func (s *state) pool(name string) *Pool {
	p := s.pools[name]
	if p == nil {
		p = &Pool{Pool: decide.Pool{Name: name, Deleted: true}, counts: map[string]int{}, members: map[string]*Proxy{}, onTarget: map[string]int{}}
		s.pools[name] = p
	}
	s.dirty[name] = struct{}{}
	return p
}

// slot is where a proxy counts toward its target's load: its
// "<entry>.<target>" while it is active.
type slot struct {
	key    string
	active bool
}

func slotOf(x *Proxy) slot {
	return slot{key: targetKey(x.Entry, x.Target), active: decide.IsActive(x.State)}
}

// move moves a proxy of pool p from slot from to slot to in the load
// counts.
func (s *state) move(p *Pool, from, to slot) {
	if from == to {
		return
	}
	add := func(m map[string]int, k string, d int) {
		if m[k] += d; m[k] == 0 {
			delete(m, k)
		}
	}
	if from.active {
		add(s.onTarget, from.key, -1)
		add(p.onTarget, from.key, -1)
	}
	if to.active {
		add(s.onTarget, to.key, 1)
		add(p.onTarget, to.key, 1)
	}
}

// decisionID is the Msg-Id of a planner decision: "<id>.<type>.<n>.<hash>",
// where n is what the decision follows (a revision or the aggregate's last
// sequence) and hash is a short digest of its data. A retry of one decision
// keeps its id (so the store recognises its own earlier success), while two
// different decisions taken from the same state never share one.
func decisionID(id, typ string, n uint64, data any) string {
	b, _ := json.Marshal(data)
	sum := sha256.Sum256(b)
	return events.ProxyEventID(id, typ, n) + "." + hex.EncodeToString(sum[:4])
}

// apply folds one event into the state. It reports whether the event can
// change a reconcile decision.
func (s *state) apply(ev bus.Event) bool {
	if ev.Seq > s.seq {
		s.seq = ev.Seq
	}
	if ev.Unreadable != nil {
		// Logged and counted by the store; never acted on, but decisions
		// expect the aggregate's last sequence, whatever it holds.
		s.noteSeq(ev)
		return false
	}
	if ev.Aggregate != events.AggregatePlanner || ev.Kind != events.PlannerFence {
		s.anchor = anchor{Seq: ev.Seq, ID: ev.Envelope.ID}
	}
	if fe := events.CheckEvent(ev.Aggregate, ev.ID, ev.Kind, ev.Source, ev.By); fe != nil {
		s.reject(ev, fe)
		return false
	}
	if x := s.proxies[ev.ID]; x != nil && ev.Aggregate == events.AggregateProxy {
		// An agent speaks only for the proxies placed on its entry and
		// target.
		if fe := events.CheckPlacement(ev.By, x.Entry, x.Target); fe != nil {
			s.reject(ev, fe)
			return false
		}
	}
	switch ev.Aggregate {
	case events.AggregatePool:
		return s.applyPool(ev)
	case events.AggregateProxy:
		return s.applyProxy(ev)
	}
	return false
}

func (s *state) skip(ev bus.Event, err error) bool {
	s.log.Warn("skipping event the planner cannot read", "seq", ev.Seq, "aggregate", ev.Aggregate, "id", ev.ID, "type", ev.Kind, "err", err)
	s.noteSeq(ev)
	return false
}

// noteSeq moves the last sequence of the event's aggregate on, for an
// event the fold does not apply: decisions are appended expecting it.
func (s *state) noteSeq(ev bus.Event) {
	switch ev.Aggregate {
	case events.AggregateProxy:
		if x := s.proxies[ev.ID]; x != nil {
			x.LastSeq = ev.Seq
		}
	case events.AggregatePool:
		if p := s.pools[ev.ID]; p != nil {
			p.LastSeq = ev.Seq
		}
	}
}

// reject skips an event with an id that breaks the identifier rule, from
// a writer not allowed to append its type, on a subject that is not its
// writer's, or from an agent the proxy was not placed on. The aggregate's last sequence
// still moves on: decisions are appended expecting it.
func (s *state) reject(ev bus.Event, fe *events.FieldError) {
	s.noteSeq(ev)
	s.rejects.Report(ev.Seq, ev.Aggregate, ev.ID, ev.Kind, ev.Source, fe)
}

func (s *state) applyPool(ev bus.Event) bool {
	switch ev.Kind {
	case events.PoolApplied:
		var d events.PoolAppliedData
		if err := ev.DecodeData(&d); err != nil {
			return s.skip(ev, err)
		}
		p := s.pool(ev.ID)
		if sh := shapeOf(d.Spec, d.SecretsDigest); sh != p.shape || p.ShapeRevision == 0 {
			p.shape, p.ShapeRevision = sh, d.Revision
		}
		var prev *events.PoolSpec
		if !p.Deleted && p.Revision > 0 {
			prev = &p.Spec
		}
		// A re-apply keeps the size autoscaling reached (within the new
		// bounds); a pool that stops autoscaling returns to its size.
		p.Autoscaled = d.Spec.SizeAfterApply(prev, p.Size())
		if d.Spec.Autoscale == nil {
			p.Autoscaled, p.ScaleReason = 0, ""
		}
		p.Spec = d.Spec.Public()
		p.Revision = d.Revision
		p.SecretsDigest = d.SecretsDigest
		p.Deleted = false
		p.LastSeq = ev.Seq
		p.traceparent, p.traceSeq = ev.Header.Get("traceparent"), ev.Seq
		for _, entry := range d.Spec.PlacementEntries() {
			s.noteTarget(entry, "")
		}
		return true
	case events.PoolDeleted:
		var d events.PoolDeletedData
		if err := ev.DecodeData(&d); err != nil {
			return s.skip(ev, err)
		}
		p := s.pool(ev.ID)
		if d.Revision > p.Revision {
			p.Revision = d.Revision
		}
		p.Deleted = true
		p.LastSeq = ev.Seq
		p.traceparent, p.traceSeq = ev.Header.Get("traceparent"), ev.Seq
		return true
	case events.PoolScaled:
		p := s.pool(ev.ID)
		// Decisions expect the aggregate's last sequence, whether this
		// fold applies the event or not.
		p.LastSeq = ev.Seq
		var d events.PoolScaledData
		if err := ev.DecodeData(&d); err != nil {
			return s.skip(ev, err)
		}
		if p.Deleted || p.Spec.Autoscale == nil {
			// Decided against an earlier revision: appended expecting the
			// pool's last sequence, it cannot follow this apply.
			return false
		}
		p.Autoscaled = p.Spec.SizeAfterScaled(d.Size)
		p.ScaleReason = d.Reason
		return true
	case events.PoolCondition:
		var d events.PoolConditionData
		if err := ev.DecodeData(&d); err != nil {
			return s.skip(ev, err)
		}
		p := s.pool(ev.ID)
		p.Conditions = events.SetCondition(p.Conditions, d, ev.Time)
		p.LastSeq = ev.Seq
		return false
	}
	if p := s.pools[ev.ID]; p != nil {
		p.LastSeq = ev.Seq
		s.dirty[p.Name] = struct{}{}
	}
	return false
}

func (s *state) setState(x *Proxy, to string) {
	if x.State == to {
		return
	}
	p := s.pool(x.Pool)
	if x.State != "" {
		if p.counts[x.State]--; p.counts[x.State] <= 0 {
			delete(p.counts, x.State)
		}
	}
	p.counts[to]++
	if to != events.ProxyRequested {
		// Only a requested proxy's create is re-issued from it.
		x.requested = events.ProxyRequestedData{}
	}
	x.State = to
	if events.IsTerminal(to) {
		delete(p.members, x.ID)
		s.finish(x)
	} else {
		p.members[x.ID] = x
	}
}

func (s *state) applyProxy(ev bus.Event) bool {
	x := s.proxies[ev.ID]
	from := ""
	if x != nil {
		// Decisions expect the aggregate's last sequence, whether this
		// fold applies the event or not.
		x.LastSeq = ev.Seq
		from = x.State
	}
	if err := events.CheckProxyData(ev.Kind, ev.Envelope); err != nil {
		return s.skip(ev, err)
	}
	if x != nil && ev.Kind == events.ProxyFailed {
		var d events.ProxyFailedData
		if ev.DecodeData(&d) == nil {
			// A quota failure or a stuck create is a fact about the
			// target, whatever the proxy's state.
			if d.Class == events.ClassQuota || d.Class == events.ClassStuck {
				s.avoid[x.Entry+"."+x.Target] = decide.Avoidance{Class: d.Class, At: ev.Time}
			}
			if x.State == events.ProxyRetiring {
				// The agent's failed delete, or a dead letter: the
				// lifecycle ignores it (a retiring proxy does not fail),
				// but it says why the proxy is still retiring.
				x.DeleteFailure = d.Class + ": " + d.Reason
			}
		}
	}
	// The lifecycle is events.Transition, shared with health's projection.
	to, ok := events.Transition(from, ev.Kind)
	if !ok {
		if x == nil {
			s.log.Debug("event for a proxy the planner never requested", "seq", ev.Seq, "proxy", ev.ID, "type", ev.Kind)
		} else {
			s.log.Debug("event ignored in the proxy's state", "seq", ev.Seq, "proxy", ev.ID, "type", ev.Kind, "state", from)
		}
		return false
	}
	if x == nil {
		if _, gone := s.abandoned[ev.ID]; gone {
			s.log.Debug("event for an abandoned proxy no longer in memory", "seq", ev.Seq, "proxy", ev.ID, "type", ev.Kind)
			return false
		}
		var d events.ProxyRequestedData
		if err := ev.DecodeData(&d); err != nil {
			return s.skip(ev, err)
		}
		x = &Proxy{
			Proxy:       decide.Proxy{ProxyView: events.NewProxyView(ev.ID, ev.Envelope.ID, ev.Seq, ev.Time, d), LastSeq: ev.Seq},
			traceparent: ev.Header.Get("traceparent"), requested: d,
		}
		x.State = ""
		s.proxies[ev.ID] = x
		if old := s.proxies[d.Replaces]; old != nil && d.Replaces != ev.ID && !events.IsTerminal(old.State) {
			old.NoteReplacement(ev.ID, d.ReplaceReason)
		}
		s.noteTarget(d.Entry, d.Target)
		s.setState(x, to)
		s.move(s.pool(x.Pool), slot{}, slotOf(x))
		return true
	}
	// The view's data, as health's projection records it.
	v := x.ProxyView
	if err := v.Apply(to, ev.Seq, ev.Kind, ev.Envelope); err != nil {
		return s.skip(ev, err)
	}
	was := slotOf(x)
	s.setState(x, to)
	x.ProxyView = v
	s.move(s.pool(x.Pool), was, slotOf(x))
	switch ev.Kind {
	case events.ProxyRequested:
		// A re-issued create: a later attempt of the same decision.
		return false
	case events.ProxyRetiring:
		x.DeleteAttempt++
		if from != events.ProxyRetiring {
			x.RetiringSince = ev.Time.UTC()
		}
		return true

	case events.ProxyFailed, events.ProxyDeleted, events.ProxyAbandoned:
		return true
	}
	// Observations of progress: once failed or retiring, a late fact from
	// an agent is recorded but the proxy stays where it is (to).
	return from != to
}

func (p *Pool) view() api.PoolView {
	v := api.PoolView{Name: p.Name, Spec: p.Spec, Revision: p.Revision, Deleted: p.Deleted, ShapeRevision: p.ShapeRevision,
		Size: p.Size(), ScaleReason: p.ScaleReason, States: map[string]int{}, Conditions: append([]events.Condition{}, p.Conditions...)}
	for _, x := range p.members {
		if decide.IsActive(x.State) && p.IsOutdated(x.Proxy) {
			v.Outdated++
		}
	}
	for k, n := range p.counts {
		if events.IsTerminal(k) {
			continue
		}
		v.States[k] = n
		if decide.IsActive(k) {
			v.Active += n
		}
	}
	return v
}

// sortedPools returns the pools ordered by name.
func (s *state) sortedPools() []*Pool {
	out := make([]*Pool, 0, len(s.pools))
	for _, p := range s.pools {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}
