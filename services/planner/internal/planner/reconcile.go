package planner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/planner/internal/apiserver"
	"proxyfleet/services/planner/internal/decide"
)

// pending is a command whose publish failed after its decision was
// appended; the reconciler retries it with the same Msg-Id.
type pending struct {
	create *events.CreateCommand
	del    *events.DeleteCommand
	trace  nats.Header
}

// poolSnap is a copy of one pool and its non-terminal proxies (what the
// rules read of them, in id order), taken under the lock so decisions run
// without it.
type poolSnap struct {
	pool    Pool
	members []decide.Proxy
}

// round is what one reconcile pass decides from.
type round struct {
	now         time.Time
	quotaAvoid  time.Duration
	checkMaxAge time.Duration
	pools       []poolSnap
	// byID holds the proxies the pools' members are, those their
	// ReplacedBy names and those the outbox names, whole.
	byID map[string]Proxy
	// targets are the live agents' targets, in key order.
	targets []decide.Target
	// known lists, per entry of a copied pool, every target ever known.
	known map[string][]string
	// avoid is the state's avoidance per "<entry>.<target>".
	avoid map[string]decide.Avoidance
	// onTarget counts active proxies per "<entry>.<target>", all pools.
	onTarget map[string]int
	// poolOnTarget counts active proxies per pool and target.
	poolOnTarget map[string]map[string]int
	// health is whether a health replica is alive.
	health  decide.Health
	secrets map[string]events.PoolSecrets
}

func targetKey(entry, target string) string { return decide.TargetKey(entry, target) }

// count adds delta to the load of target key k, overall and for pool.
func (r *round) count(pool, k string, delta int) {
	r.onTarget[k] += delta
	if r.poolOnTarget[pool] == nil {
		r.poolOnTarget[pool] = map[string]int{}
	}
	r.poolOnTarget[pool][k] += delta
}

// placement is the view placement reads for a proxy of pool (placed over
// entries): the round's live targets and their load as the round's
// decisions so far left it. The targets known for a pool of several
// entries are named "<entry>/<target>".
func (r *round) placement(pool string, entries []string) *decide.Placement {
	if r.poolOnTarget[pool] == nil {
		r.poolOnTarget[pool] = map[string]int{}
	}
	known := r.known[entries[0]]
	if len(entries) > 1 {
		known = nil
		for _, e := range entries {
			for _, t := range r.known[e] {
				known = append(known, e+"/"+t)
			}
		}
	}
	return &decide.Placement{Now: r.now, Targets: r.targets, Avoid: r.avoid, Known: known, QuotaAvoid: r.quotaAvoid, CheckMaxAge: r.checkMaxAge,
		Load: decide.Load{All: r.onTarget, Pool: r.poolOnTarget[pool]}}
}

// replacementsOf returns the proxies members' ReplacedBy names, by id.
func (r *round) replacementsOf(members []decide.Proxy) map[string]decide.Proxy {
	var out map[string]decide.Proxy
	for _, x := range members {
		if x.ReplacedBy == "" {
			continue
		}
		if y, ok := r.byID[x.ReplacedBy]; ok {
			if out == nil {
				out = map[string]decide.Proxy{}
			}
			out[y.ID] = y.Proxy
		}
	}
	return out
}

// replacement returns the live proxy requested to replace x, if any.
func (r *round) replacement(x Proxy) (Proxy, bool) {
	y, ok := decide.Replacement(r.replacementsOf([]decide.Proxy{x.Proxy}), x.Proxy)
	if !ok {
		return Proxy{}, false
	}
	return r.byID[y.ID], true
}

// snapshot copies every pool: the input of a round that looks at the
// whole fleet.
func (rc *reconciler) snapshot() *round { return rc.roundOf(nil, false) }

// roundOf copies, under the lock, the pools named in names (every pool
// when names is nil), their live members, the load of every target and
// the proxies the reconciler's outbox names, so decisions run without the
// lock. With takeDirty the pools events touched since the last take are
// copied too, and the dirty set starts afresh: an event folded after the
// copy marks its pool for the next round.
func (rc *reconciler) roundOf(names map[string]bool, takeDirty bool) *round {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	r := &round{
		now:          rc.now(),
		quotaAvoid:   rc.cfg.QuotaAvoid,
		checkMaxAge:  rc.cfg.CheckMaxAge,
		known:        map[string][]string{},
		avoid:        make(map[string]decide.Avoidance, len(rc.st.avoid)),
		onTarget:     make(map[string]int, len(rc.st.onTarget)),
		poolOnTarget: map[string]map[string]int{},
		secrets:      map[string]events.PoolSecrets{},
	}
	r.health = rc.healthLocked(r.now)
	for _, a := range rc.liveAgentsLocked(r.now) {
		t := a.target()
		t.Check = rc.health.checks[t.Key()]
		r.targets = append(r.targets, t)
	}
	sort.Slice(r.targets, func(i, j int) bool { return r.targets[i].Key() < r.targets[j].Key() })
	for k, a := range rc.st.avoid {
		r.avoid[k] = a
	}
	for k, n := range rc.st.onTarget {
		r.onTarget[k] = n
	}
	var pools []*Pool
	if names == nil {
		pools = rc.st.sortedPools()
	} else {
		if takeDirty {
			for name := range rc.st.dirty {
				names[name] = true
			}
		}
		for name := range names {
			if pl := rc.st.pools[name]; pl != nil {
				pools = append(pools, pl)
			}
		}
		sort.Slice(pools, func(i, j int) bool { return pools[i].Name < pools[j].Name })
	}
	if takeDirty {
		clear(rc.st.dirty)
	}
	members := 0
	for _, pl := range pools {
		members += len(pl.members)
	}
	r.byID = make(map[string]Proxy, members+len(rc.outbox))
	for _, pl := range pools {
		ps := poolSnap{pool: *pl, members: make([]decide.Proxy, 0, len(pl.members))}
		ps.pool.counts, ps.pool.members, ps.pool.onTarget = nil, nil, nil
		for _, x := range pl.members {
			ps.members = append(ps.members, x.Proxy)
			r.byID[x.ID] = *x
		}
		for _, entry := range pl.Spec.PlacementEntries() {
			if _, ok := r.known[entry]; !ok {
				known, _ := rc.knownTargetsLocked(entry)
				r.known[entry] = slices.Sorted(maps.Keys(known))
			}
		}
		slices.SortFunc(ps.members, func(a, b decide.Proxy) int { return strings.Compare(a.ID, b.ID) })
		load := make(map[string]int, len(pl.onTarget))
		for k, n := range pl.onTarget {
			load[k] = n
		}
		r.poolOnTarget[pl.Name] = load
		r.pools = append(r.pools, ps)
	}
	// A replacement lives in its pool, but a proxy's ReplacedBy may name
	// one the copy lacks (its pool was not copied); the outbox names
	// proxies of any pool.
	for _, ps := range r.pools {
		for _, x := range ps.members {
			if y := rc.st.proxies[x.ReplacedBy]; x.ReplacedBy != "" && y != nil {
				if _, ok := r.byID[y.ID]; !ok {
					r.byID[y.ID] = *y
				}
			}
		}
	}
	for id := range rc.outbox {
		if x := rc.st.proxies[id]; x != nil {
			r.byID[id] = *x
		}
	}
	return r
}

// reconcileLoop runs while this replica leads.
func (rc *reconciler) reconcileLoop(ctx context.Context) {
	rc.noteTraced(rc.l.term.Seq)
	rc.recoverCommands(ctx)
	svc, err := rc.api.Start(apiserver.Leader)
	if err != nil {
		rc.log.Error("the leader's deciding endpoints could not be added; recycle, report-ban, proxy.delete and instance.delete are not served", "err", err)
	} else {
		defer func() { _ = svc.Stop() }()
	}
	inv := make(chan inventory)
	gctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { rc.gatherLoop(gctx, inv) })
	wg.Go(func() { rc.demand.watch(gctx) })
	defer func() { cancel(); wg.Wait() }()
	t := time.NewTicker(rc.cfg.ReconcileInterval)
	defer t.Stop()
	scale := time.NewTicker(rc.cfg.AutoscaleInterval)
	defer scale.Stop()
	files := time.NewTicker(rc.cfg.ExternalFileInterval)
	defer files.Stop()
	rc.watchFiles(ctx)
	for {
		took := rc.reconcile(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-rc.kick:
			rc.rest(ctx, took)
		case <-scale.C:
			rc.autoscale(ctx)
		case <-files.C:
			rc.watchFiles(ctx)
		case in := <-inv:
			rc.collectGarbage(ctx, in)
		case j := <-rc.l.jobs:
			rc.runJob(ctx, j)
		}
	}
}

// recoverCommands re-publishes the command of every proxy whose decision
// may not have reached its agent when the previous leader stopped: creates
// of requested proxies and deletes of retiring ones, with the same attempt
// and so the same Msg-Id. Inside the duplicate window JetStream drops them;
// outside it the agents find the work done.
func (rc *reconciler) recoverCommands(ctx context.Context) {
	r := rc.snapshot()
	f := rc.flight(ctx)
	n := 0
	for _, ps := range r.pools {
		for _, m := range ps.members {
			x := r.byID[m.ID]
			switch {
			case externalOf(x):
				// No command is ever sent for an external proxy.
			case x.State == events.ProxyRequested:
				sec, ok := rc.poolSecrets(ctx, r, ps.pool)
				if !ok {
					continue
				}
				rc.sealedCreate(causedBy(ctx, x.traceparent), f, x.ID, x.requested, x.Attempt, sec, r.xkey(x.Entry, x.Target))
				n++
			case x.State == events.ProxyRetiring && !x.SkipCleanup:
				cmd := deleteCommand(x, x.DeleteAttempt)
				f.command(causedBy(ctx, ps.pool.traceparent), pending{del: &cmd})
				n++
			}
		}
	}
	f.wait()
	if n > 0 {
		rc.log.Info("re-published the commands of unfinished decisions", "commands", n)
	}
}

// maxRest bounds the rest between a round and the next one events ask for.
const maxRest = 250 * time.Millisecond

// rest waits as long as the last round took, up to maxRest, before a round
// events asked for. During a burst (a large pool filling, every event
// touching it) rounds would otherwise follow each other without a break,
// each over the whole pool: resting as long as a round keeps the planner
// within half a CPU, and the events of the rest are decided together in
// the next round. A small fleet's rounds take microseconds, and so do its
// rests.
func (rc *reconciler) rest(ctx context.Context, took time.Duration) {
	if took <= 0 {
		return
	}
	t := time.NewTimer(min(took, maxRest))
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// sweepInterval is how often a round looks at every pool, whatever
// changed: a safety net under the rounds that look at the pools events
// touched and the pools whose timers came due.
const sweepInterval = time.Minute

// reconcile runs one pass over the pools that need one: those events
// touched since the last pass, those whose timers came due, and every pool
// once a sweepInterval (and in a leader's first pass). Its work is
// proportional to those pools, not to the fleet. It returns how long the
// round took, 0 when it did not run.
func (rc *reconciler) reconcile(ctx context.Context) time.Duration {
	rc.mu.Lock()
	behind := rc.st.seq < rc.ownSeq
	rc.mu.Unlock()
	if behind {
		// Our own last decision is not in the projection yet: deciding now
		// would count without it.
		return 0
	}
	start := time.Now()
	now, ageNow := rc.now(), rc.ageNow()
	var names map[string]bool
	rc.mu.Lock()
	healthDown := rc.healthLocked(now).Down
	rc.mu.Unlock()
	if rc.lastSweep.IsZero() || now.Sub(rc.lastSweep) >= sweepInterval || healthDown != rc.healthDown {
		// Health going or coming back changes every pool's readiness
		// and ready timeouts: every pool is looked at.
		rc.lastSweep, rc.healthDown = now, healthDown
	} else {
		names = map[string]bool{}
		for pool, t := range rc.timers {
			if t.IsDue(now, ageNow) {
				names[pool] = true
			}
		}
	}
	r := rc.roundOf(names, true)
	f := rc.flight(ctx)
	rc.flushOutbox(ctx, r, f)
	for _, ps := range r.pools {
		if ctx.Err() != nil {
			break
		}
		rc.looked.Add(1)
		t := rc.reconcilePool(ctx, r, ps, f)
		if t == (decide.When{}) {
			delete(rc.timers, ps.pool.Name)
		} else {
			rc.timers[ps.pool.Name] = t
		}
	}
	f.wait()
	for pool := range f.unstored {
		t := rc.timers[pool]
		t.Retry = true
		rc.timers[pool] = t
	}
	took := time.Since(start)
	if ctx.Err() == nil {
		rc.rounds.Add(1)
		rc.m.reconcile.Record(ctx, took.Seconds())
	}
	return took
}

func (rc *reconciler) flushOutbox(ctx context.Context, r *round, f *flight) {
	for id, pc := range rc.outbox {
		x, ok := r.byID[id]
		want := events.ProxyRetiring
		if pc.create != nil {
			want = events.ProxyRequested
		}
		delete(rc.outbox, id)
		if ok && x.State == want {
			f.command(telemetry.Extract(ctx, pc.trace), pc)
		}
	}
}

// reconcilePool decides what one pool needs (see package decide), has
// the writer apply it, and returns when a round must look at the pool
// again if no event touches it.
func (rc *reconciler) reconcilePool(ctx context.Context, r *round, ps poolSnap, f *flight) decide.When {
	pool := ps.pool
	if decide.IsExternal(&pool.Pool) {
		return rc.reconcileExternal(ctx, r, ps, f)
	}
	pctx := rc.poolCtx(ctx, pool)
	in := &decide.Input{
		Now: r.now, AgeNow: rc.ageNow(), Config: rc.rules, Pool: pool.Pool, Members: ps.members,
		Replacements: r.replacementsOf(ps.members), Placement: r.placement(pool.Name, pool.Spec.PlacementEntries()), Health: r.health,
	}
	plan := decide.Reconcile(in)
	found := plan.Found
	if miss := rc.applyPlan(pctx, r, f, pool, plan); miss != nil {
		found.Miss = miss
	}
	if m := plan.Found.Miss; m != nil {
		rc.noPlace(r, pool, *m, plan.Found.Missing)
	}
	if !pool.Deleted && ctx.Err() == nil {
		rc.updateConditions(pctx, f, pool, decide.Changed(&pool.Pool, decide.Conditions(&pool.Pool, plan.Want, &found, rc.ageNow())))
	}
	// A spread short of a value no target can take waits, like a miss,
	// for a target to come (back) or make room: no event of the pool's
	// says when.
	return decide.Timer(rc.rules, &pool.Pool, ps.members, r.health, found.Miss != nil || found.SpreadShort != "", rc.ageNow())
}

// applyPlan hands one pool's decisions to the writer, in order. A create
// the writer refuses (the pool's secrets cannot be read, or cannot be
// sealed to the chosen target's agent) ends the pool's creates for this
// round; applyPlan returns why, for the pool's Placed condition.
func (rc *reconciler) applyPlan(pctx context.Context, r *round, f *flight, pool Pool, plan decide.Plan) *decide.Miss {
	var miss *decide.Miss
	for _, d := range plan.Decisions {
		if pctx.Err() != nil {
			break
		}
		x := r.byID[d.Proxy.ID]
		ctx := pctx
		if d.CausedBy != "" {
			if y, ok := r.byID[d.CausedBy]; ok && y.traceparent != "" {
				ctx = causedBy(pctx, y.traceparent)
			}
		}
		if externalOf(x) && d.Kind != decide.Create {
			// A proxy left from before the pool stopped being external:
			// it is forgotten as the external agent, never sent a command.
			rc.forgetExternal(ctx, f, x, d.Reason)
			continue
		}
		if d.Note != "" && d.Kind != decide.Create {
			rc.log.InfoContext(ctx, d.Note, "pool", pool.Name, "proxy", x.ID, "unhealthySince", x.UnhealthySince,
				"unhealthyAfter", pool.Spec.UnhealthyAfterOrDefault().String())
		}
		switch d.Kind {
		case decide.Retire:
			rc.retire(ctx, r, f, x, d.Reason, d.Class, false)
		case decide.Abandon:
			ab := events.ProxyAbandonedData{Reason: d.Reason}
			rc.decide(ctx, f, x, events.ProxyAbandoned, decisionID(x.ID, events.ProxyAbandoned, x.LastSeq, ab), ab, nil)
		case decide.Redelete:
			rc.reissueDelete(ctx, f, x)
		case decide.Recreate:
			rc.reissueCreate(ctx, r, f, pool, x)
		case decide.Fail:
			fd := events.ProxyFailedData{Class: d.Class, Reason: d.Reason, Attempt: x.Attempt}
			rc.decide(ctx, f, x, events.ProxyFailed, decisionID(x.ID, events.ProxyFailed, x.LastSeq, fd), fd, nil)
		case decide.Create:
			if miss != nil {
				continue
			}
			if _, miss = rc.create(ctx, r, f, pool, d.Target, d.Proxy.ID, d.Reason); miss != nil {
				continue
			}
			delete(rc.noTarget, pool.Name)
			if d.Note != "" {
				rc.log.InfoContext(ctx, d.Note, "pool", pool.Name, "proxy", d.Proxy.ID,
					"why", d.Reason, "age", rc.ageNow().Sub(d.Proxy.CreatedAt).Round(time.Second).String(),
					"proxyRevision", d.Proxy.Revision, "shapeRevision", pool.ShapeRevision)
			}
		}
	}
	return miss
}

// noPlace logs, at most once a minute per pool, that the pool's missing
// proxies cannot be placed now.
func (rc *reconciler) noPlace(r *round, pool Pool, m decide.Miss, missing int) {
	if last, logged := rc.noTarget[pool.Name]; !logged || r.now.Sub(last) >= time.Minute {
		rc.noTarget[pool.Name] = r.now
		rc.log.Warn("no live target can take a proxy of this pool now; retrying every round",
			"pool", pool.Name, "entries", pool.Spec.PlacementEntries(), "missing", missing, "reason", m.Reason, "detail", m.Message)
	}
}

// poolSecrets reads the pool's secrets from fleet-secrets, checking they
// belong to the applied revision (their digest is in the event).
func (rc *reconciler) poolSecrets(ctx context.Context, r *round, pool Pool) (events.PoolSecrets, bool) {
	if pool.Deleted {
		// pool.delete removed them; a deleted pool creates nothing.
		return events.PoolSecrets{}, false
	}
	if s, ok := r.secrets[pool.Name]; ok {
		return s, true
	}
	var s events.PoolSecrets
	e, err := rc.secrets.kv.Get(ctx, pool.Name)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
	case err != nil:
		rc.log.Warn("read pool secrets", "pool", pool.Name, "err", err)
		return s, false
	default:
		if err := json.Unmarshal(e.Value(), &s); err != nil {
			rc.log.Error("pool secrets are unreadable; re-apply the pool", "pool", pool.Name, "err", err)
			return s, false
		}
	}
	if !s.Matches(rc.secrets.digestKey, pool.SecretsDigest) {
		rc.log.Error("pool secrets do not match the applied revision; re-apply the pool", "pool", pool.Name, "revision", pool.Revision)
		return s, false
	}
	r.secrets[pool.Name] = s
	return s, true
}

// createCommand builds the create command of proxy id. The pool's secrets
// travel sealed to the agent's curve key xkey, never in plaintext; a pool
// without secrets needs no key.
func createCommand(id string, d events.ProxyRequestedData, attempt int, sec events.PoolSecrets, xkey string) (events.CreateCommand, error) {
	cmd := events.CreateCommand{
		ProxyID: id, ProxySpec: d.ProxySpec.Clone(), Attempt: attempt,
	}
	if d.Username != "" {
		cmd.Auth = &events.ProxyAuth{Username: d.Username}
	}
	if sec.Empty() {
		return cmd, nil
	}
	if xkey == "" {
		return cmd, errNoAgentKey
	}
	plain, _ := json.Marshal(events.CommandSecrets{ProxyID: id, Password: sec.Password, UserData: []byte(sec.UserData)})
	box, err := seal.Seal(plain, xkey)
	clear(plain)
	if err != nil {
		return cmd, err
	}
	cmd.Sealed = box
	return cmd, nil
}

// errNoAgentKey: the agent announced no curve key to seal secrets to.
var errNoAgentKey = errors.New("the agent announced no curve key to seal the pool's secrets to")

// xkey returns the curve key the agent of entry/target announced, or "".
func (r *round) xkey(entry, target string) string {
	for _, a := range r.targets {
		if a.Entry == entry && a.Target == target {
			return a.XKey
		}
	}
	return ""
}

// sealedCreate builds a create command for a decision already stored; when
// it cannot be sealed (the agent's key vanished with its heartbeat) the
// command is not sent and waits: the create timeout issues it again.
func (rc *reconciler) sealedCreate(ctx context.Context, f *flight, id string, d events.ProxyRequestedData, attempt int, sec events.PoolSecrets, xkey string) {
	cmd, err := createCommand(id, d, attempt, sec, xkey)
	if err != nil {
		rc.log.WarnContext(ctx, "create command not sent: its secrets cannot be sealed; it is issued again after the create timeout",
			"proxy", id, "entry", d.Entry, "target", d.Target, "err", err)
		return
	}
	f.command(ctx, pending{create: &cmd})
}

func deleteCommand(x Proxy, attempt int) events.DeleteCommand {
	if attempt < 1 {
		attempt = 1
	}
	return events.DeleteCommand{
		ProxyID: x.ID, Pool: x.Pool, Entry: x.Entry, Target: x.Target, Instance: x.Instance,
		ProviderID: x.ProviderID, Attempt: attempt, Reason: x.Reason,
	}
}

// verb is the command's verb: create or delete.
func (pc pending) verb() string {
	if pc.create != nil {
		return events.VerbCreate
	}
	return events.VerbDelete
}

// startCommand starts the producer span of publishing pc.
func (p *Planner) startCommand(ctx context.Context, pc pending) (context.Context, trace.Span) {
	var id, entry, target string
	if pc.create != nil {
		id, entry, target = pc.create.ProxyID, pc.create.Entry, pc.create.Target
	} else {
		id, entry, target = pc.del.ProxyID, pc.del.Entry, pc.del.Target
	}
	verb := pc.verb()
	return p.startPublish(ctx, events.CommandSubject(entry, target, verb), events.CommandSubject("{entry}", "{target}", verb),
		attribute.String("proxy", id), attribute.String("entry", entry), attribute.String("target", target))
}

func (rc *reconciler) noteOwn(seq uint64) {
	if seq > rc.ownSeq {
		rc.ownSeq = seq
	}
}

// decide sends one planner decision about proxy x, expecting x's last
// sequence; stored, if not nil, runs once it is stored. A conflict means x
// changed meanwhile; the next round decides again from the newer state.
func (rc *reconciler) decide(ctx context.Context, f *flight, x Proxy, typ, msgID string, data any, stored func(context.Context, uint64)) *unit {
	ctx, span := rc.startWork(ctx, "planner."+typ, trace.SpanKindInternal,
		attribute.String("proxy", x.ID), attribute.String("pool", x.Pool))
	return f.decide(ctx, span, x.Pool, events.AggregateProxy, x.ID, &bus.Expect{Seq: x.LastSeq}, []bus.Decision{{Type: typ, MsgID: msgID, Data: data}},
		[]any{"proxy", x.ID, "pool", x.Pool, "decision", typ, "entry", x.Entry, "target", x.Target}, stored)
}

// retire decides that x retires for reason and, once that is stored,
// sends its delete command. replaced, when not "", is the reason the
// retirement is counted as a replacement for (the fill replaces x). With
// skipCleanup the proxy is abandoned in the same unit instead: its
// instance is left alone and no command is sent. r, when not nil, is the
// round whose load counts x out at once.
func (rc *reconciler) retire(pctx context.Context, r *round, f *flight, x Proxy, reason, replaced string, skipCleanup bool) *unit {
	ctx, span := rc.startWork(pctx, "planner.retire", trace.SpanKindInternal,
		attribute.String("proxy", x.ID), attribute.String("pool", x.Pool), attribute.String("reason", reason))
	d := events.ProxyRetiringData{Reason: reason, SkipCleanup: skipCleanup}
	if r != nil && decide.IsActive(x.State) {
		// Counted out at once: later placements of this round see it gone
		// (a refused retire is decided again next round).
		r.count(x.Pool, targetKey(x.Entry, x.Target), -1)
	}
	x.Reason = reason
	ds := []bus.Decision{{Type: events.ProxyRetiring, MsgID: decisionID(x.ID, events.ProxyRetiring, x.LastSeq, d), Data: d}}
	typ := events.ProxyRetiring
	if skipCleanup {
		ab := events.ProxyAbandonedData{Reason: reason}
		ds = append(ds, bus.Decision{Type: events.ProxyAbandoned, MsgID: decisionID(x.ID, events.ProxyAbandoned, x.LastSeq+1, ab), Data: ab})
		typ = events.ProxyAbandoned
	}
	return f.decide(ctx, span, x.Pool, events.AggregateProxy, x.ID, &bus.Expect{Seq: x.LastSeq}, ds,
		[]any{"proxy", x.ID, "pool", x.Pool, "decision", typ, "reason", reason, "entry", x.Entry, "target", x.Target},
		func(ctx context.Context, _ uint64) {
			if replaced != "" {
				rc.m.replaced(ctx, x.Pool, replaced)
			}
			if !skipCleanup {
				cmd := deleteCommand(x, 1)
				f.command(ctx, pending{del: &cmd})
			}
		})
}

func (rc *reconciler) reissueDelete(pctx context.Context, f *flight, x Proxy) {
	attempt := x.DeleteAttempt + 1
	ctx, span := rc.startWork(pctx, "planner.redelete", trace.SpanKindInternal,
		attribute.String("proxy", x.ID), attribute.String("pool", x.Pool), attribute.Int("attempt", attempt))
	d := events.ProxyRetiringData{Reason: x.Reason}
	f.decide(ctx, span, x.Pool, events.AggregateProxy, x.ID, &bus.Expect{Seq: x.LastSeq},
		[]bus.Decision{{Type: events.ProxyRetiring, MsgID: decisionID(x.ID, events.ProxyRetiring, x.LastSeq, d), Data: d}},
		[]any{"proxy", x.ID, "pool", x.Pool, "decision", events.ProxyRetiring, "entry", x.Entry, "target", x.Target, "attempt", attempt},
		func(ctx context.Context, _ uint64) {
			cmd := deleteCommand(x, attempt)
			f.command(ctx, pending{del: &cmd})
		})
}

// reissueCreate issues the create of x, requested too long, again with the
// next attempt (decide chose to: its agent is alive and attempts are
// left). It waits while the pool's secrets cannot be sealed to the agent.
func (rc *reconciler) reissueCreate(ctx context.Context, r *round, f *flight, pool Pool, x Proxy) {
	sec, ok := rc.poolSecrets(ctx, r, pool)
	if !ok {
		return
	}
	xkey := r.xkey(x.Entry, x.Target)
	if !sec.Empty() && xkey == "" {
		// Nothing to seal the secrets to: issuing the attempt would only
		// store a command that is never sent.
		return
	}
	attempt := x.Attempt + 1
	ctx, span := rc.startWork(ctx, "planner.recreate", trace.SpanKindInternal,
		attribute.String("proxy", x.ID), attribute.String("pool", x.Pool), attribute.Int("attempt", attempt))
	f.decide(ctx, span, x.Pool, events.AggregateProxy, x.ID, &bus.Expect{Seq: x.LastSeq},
		[]bus.Decision{{Type: events.ProxyRequested, MsgID: events.ProxyEventID(x.ID, events.ProxyRequested, uint64(attempt)), Data: x.requested}},
		[]any{"proxy", x.ID, "pool", x.Pool, "decision", events.ProxyRequested, "entry", x.Entry, "target", x.Target, "attempt", attempt},
		func(ctx context.Context, _ uint64) {
			rc.sealedCreate(ctx, f, x.ID, x.requested, attempt, sec, xkey)
		})
}

// create decides one new proxy of pool on target a and sends its command
// once the decision is stored. replaces names the proxy it is to replace,
// if any, and why says why (the replaced proxy's retiring reason once this
// one is ready). It returns why nothing was decided: the pool's secrets
// cannot be read, or the target's agent announced no key to seal them to.
func (rc *reconciler) create(pctx context.Context, r *round, f *flight, pool Pool, a decide.Target, replaces, why string) (*unit, *decide.Miss) {
	sec, ok := rc.poolSecrets(pctx, r, pool)
	if !ok {
		return nil, &decide.Miss{Reason: events.ReasonSecretsUnavailable,
			Message: fmt.Sprintf("the pool's secrets cannot be read or do not match revision %d; re-apply the pool", pool.Revision)}
	}
	if !sec.Empty() && a.XKey == "" {
		return nil, &decide.Miss{Reason: events.ReasonSecretsUnavailable,
			Message: fmt.Sprintf("target %s/%s: its agent announced no curve key to seal the pool's password and user-data to (an agent older than sealed commands?); creates wait until it does", a.Entry, a.Target)}
	}
	req := newRequest(pool, a, replaces, why)
	ctx, span := rc.startRequest(pctx, req)
	// Counted at once, so the next placement of this round spreads (a
	// refused create is decided again next round).
	r.count(pool.Name, a.Key(), 1)
	u := f.decide(ctx, span, pool.Name, events.AggregateProxy, req.id, &bus.Expect{Seq: 0},
		[]bus.Decision{{Type: events.ProxyRequested, MsgID: req.msgID, Data: req.data}}, req.logArgs(),
		func(ctx context.Context, _ uint64) {
			if replaces != "" {
				rc.m.replaced(ctx, pool.Name, why)
			}
			rc.sealedCreate(ctx, f, req.id, req.data, 1, sec, a.XKey)
		})
	return u, nil
}

// proxyRequest is one decision to create a proxy: the reconciler's fills
// and rotations and the API's replacements build it alike.
type proxyRequest struct {
	id    string
	data  events.ProxyRequestedData
	msgID string
	why   string
}

// newRequest decides a new proxy of pool on target a, replacing replaces
// (for why) if set.
func newRequest(pool Pool, a decide.Target, replaces, why string) proxyRequest {
	id := events.NewProxyID(pool.Name)
	return proxyRequest{id: id, data: requestedData(id, pool, a, replaces, why),
		msgID: events.ProxyEventID(id, events.ProxyRequested, 1), why: why}
}

// startRequest opens the span of a request.
func (p *Planner) startRequest(ctx context.Context, req proxyRequest) (context.Context, trace.Span) {
	d := req.data
	return p.startWork(ctx, "planner.create", trace.SpanKindInternal,
		attribute.String("proxy", req.id), attribute.String("pool", d.Pool), attribute.String("replaces", d.Replaces),
		attribute.String("entry", d.Entry), attribute.String("target", d.Target))
}

// logArgs are the attributes of the request's "decided" log line.
func (req proxyRequest) logArgs() []any {
	d := req.data
	return []any{"proxy", req.id, "pool", d.Pool, "decision", events.ProxyRequested,
		"entry", d.Entry, "target", d.Target, "replaces", d.Replaces, "why", req.why}
}

// requestedData is the decision to create proxy id of pool on target a.
func requestedData(id string, pool Pool, a decide.Target, replaces, why string) events.ProxyRequestedData {
	d := events.ProxyRequestedData{
		ProxySpec: events.ProxySpec{
			Pool: pool.Name, Entry: a.Entry, Target: a.Target, Instance: events.InstanceName(id),
			Revision: pool.Revision, Image: pool.Spec.Image, Profile: pool.Spec.Profile, Port: pool.Spec.Port, Egress: pool.Spec.Egress.Clone(),
		},
		Replaces: replaces, ReplaceReason: why, Labels: maps.Clone(a.Labels),
	}
	if pool.Spec.Auth != nil {
		d.Username = pool.Spec.Auth.Username
	}
	return d
}
