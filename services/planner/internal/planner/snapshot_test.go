package planner

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime/pprof"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/page"
	"proxyfleet/services/planner/internal/decide"
)

// testKeep is how many finished proxies the snapshot tests keep in
// memory: few, so older ones leave it in every history.
const testKeep = 20

// observedAt is the clock of every observation: the round's view of time
// must not differ between two states compared.
var observedAt = time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)

// foldEvents folds the events of evs up to sequence upto into a new state.
func foldEvents(evs []bus.Event, upto uint64) *state {
	st := newState(testLogger(), testKeep)
	applyEvents(st, evs, 0, upto)
	return st
}

// applyEvents applies the events of evs with a sequence in (after, upto].
func applyEvents(st *state, evs []bus.Event, after, upto uint64) {
	for _, e := range evs {
		if e.Seq > after && e.Seq <= upto {
			st.apply(e)
		}
	}
}

// roundTrip encodes st as a snapshot and decodes it into a new state.
func roundTrip(t *testing.T, st *state) *state {
	t.Helper()
	var buf bytes.Buffer
	if err := st.image().encode(&buf); err != nil {
		t.Fatalf("encode: %v", err)
	}
	out, err := decodeSnapshot(&buf, testLogger(), testKeep)
	if err != nil {
		t.Fatalf("decode: %v", err)
	}
	return out
}

// observer is a planner that holds st and runs no loops: its API handlers
// answer from st.
func observer(t *testing.T, c *bus.Conn, st *state) *Planner {
	t.Helper()
	p, err := New(c, Config{ID: "observer", KeepFinished: testKeep}, testLogger(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	p.st = st
	p.now = func() time.Time { return observedAt }
	return p
}

// logNames returns every pool and proxy id the events name.
func logNames(evs []bus.Event) (pools, proxies []string) {
	ps, xs := map[string]bool{}, map[string]bool{}
	for _, e := range evs {
		switch e.Aggregate {
		case events.AggregatePool:
			ps[e.ID] = true
		case events.AggregateProxy:
			xs[e.ID] = true
		}
	}
	for k := range ps {
		pools = append(pools, k)
	}
	for k := range xs {
		proxies = append(proxies, k)
	}
	sort.Strings(pools)
	sort.Strings(proxies)
	return pools, proxies
}

// observe returns what p answers, by request: pool.list, pool.get of every
// pool, proxy.list, the view of every proxy it holds in memory (proxy.get
// answers the others from the log, the same way for every state), and
// the input of its next reconcile round (pools, members and counts per
// target, in the order the round decides them).
func observe(t *testing.T, p *Planner, pools, proxies []string) map[string]string {
	t.Helper()
	out := map[string]string{}
	put := func(key string, v any, aerr *api.APIError) {
		b, err := json.Marshal(struct {
			V any
			E *api.APIError
		}{v, aerr})
		if err != nil {
			t.Fatal(err)
		}
		out[key] = string(b)
	}
	b := backend{p}
	put("pool.list", b.Pools("", page.DefaultLimit+1), nil)
	for _, name := range pools {
		v, ok := b.Pool(name)
		put("pool.get "+name, v, nil)
		if !ok {
			out["pool.get "+name] = "unknown pool"
		}
	}
	put("proxy.list", b.Proxies("", "", page.DefaultLimit+1), nil)
	p.mu.Lock()
	checkLoad(t, p.st)
	for _, id := range proxies {
		if x := p.st.proxies[id]; x != nil {
			put("proxy "+id, x.ProxyView, nil)
		} else {
			out["proxy "+id] = "not in memory"
		}
	}
	out["seq"] = fmt.Sprint(p.st.seq, p.st.anchor)
	p.mu.Unlock()
	r := newReconciler(p, nil).snapshot() // a round's copy, as a reconciler takes it
	for _, ps := range r.pools {
		// The spec as JSON: %+v prints its pointer fields (autoscale,
		// gateway, egress) as addresses.
		spec, _ := json.Marshal(ps.pool.Spec)
		ps.pool.Spec = events.PoolSpec{}
		out["round pool "+ps.pool.Name] = fmt.Sprintf("%+v %s", ps, spec)
	}
	out["round counts"] = fmt.Sprintf("%v %v %v", r.onTarget, r.poolOnTarget, r.avoid)
	return out
}

// diffObserved fails t with the requests two observations answer
// differently.
func diffObserved(t *testing.T, what string, got, want map[string]string) {
	t.Helper()
	var keys []string
	for k := range want {
		keys = append(keys, k)
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	n := 0
	for _, k := range keys {
		if got[k] != want[k] {
			if n < 5 {
				t.Errorf("%s: %s differs:\n got  %s\n want %s", what, k, got[k], want[k])
			}
			n++
		}
	}
	if n > 0 {
		t.Fatalf("%s: %d answers differ from a full replay", what, n)
	}
}

// cutPoints returns the sequences to snapshot at: spread over the log,
// the first and last ones, and the insides of bursts (right after every
// requested event a stride picks, while its proxy's agent facts are still
// to come).
func cutPoints(evs []bus.Event, spread int) []uint64 {
	set := map[uint64]bool{0: true}
	last := evs[len(evs)-1].Seq
	for i := 1; i <= spread; i++ {
		set[last*uint64(i)/uint64(spread)] = true
	}
	n := 0
	for i, e := range evs {
		if e.Kind == events.ProxyRequested && i+1 < len(evs) {
			if n%max(1, len(evs)/(8*spread)) == 0 {
				set[e.Seq] = true
				set[evs[i+1].Seq] = true
			}
			n++
		}
	}
	out := make([]uint64, 0, len(set))
	for k := range set {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// TestSnapshotPlusTailEqualsReplay: for a generated history of mixed
// activity, the state from a snapshot taken at sequence k plus the events
// after k answers every request as the state from a full replay does, for
// many k, inside bursts included.
func TestSnapshotPlusTailEqualsReplay(t *testing.T) {
	h := newHarness(t)
	g := newLogGen(t, h.c, 7)
	g.fill(4000)
	evs := streamEvents(t, h.c, 0)
	pools, proxies := logNames(evs)
	last := evs[len(evs)-1].Seq
	want := observe(t, observer(t, h.c, foldEvents(evs, last)), pools, proxies)
	if !strings.Contains(want["pool.list"], `"ready"`) || len(proxies) < 200 {
		t.Fatalf("the generated history is too thin: %d proxies, pool.list %s", len(proxies), want["pool.list"])
	}
	cuts := cutPoints(evs, 12)
	// The full replay's answers at every cut point.
	at := map[uint64]map[string]string{last: want}
	ref := newState(testLogger(), testKeep)
	prev := uint64(0)
	for _, k := range cuts {
		applyEvents(ref, evs, prev, k)
		prev = k
		at[k] = observe(t, observer(t, h.c, roundTrip(t, ref)), pools, proxies)
	}
	for i, k := range cuts {
		st := roundTrip(t, foldEvents(evs, k))
		if st.seq != k {
			t.Fatalf("snapshot at %d: decoded seq %d", k, st.seq)
		}
		diffObserved(t, fmt.Sprintf("snapshot at %d", k), observe(t, observer(t, h.c, st), pools, proxies), at[k])
		// The tail in steps: the next cut points, then the end.
		from := k
		for _, m := range append(cuts[i+1:min(i+4, len(cuts))], last) {
			applyEvents(st, evs, from, m)
			from = m
			diffObserved(t, fmt.Sprintf("snapshot at %d + tail to %d", k, m), observe(t, observer(t, h.c, st), pools, proxies), at[m])
		}
	}
	t.Logf("%d events, %d proxies, %d pools, %d cut points", len(evs), len(proxies), len(pools), len(cuts))
}

// TestSnapshotEquivalenceWithPlannerDecisions: the same holds for a log a
// leader wrote while reconciling (terms, fences, conditions, its own
// decisions), driven by the test's agent and health stand-ins.
func TestSnapshotEquivalenceWithPlannerDecisions(t *testing.T) {
	h := newHarness(t)
	r := h.mixedActivity()
	r.stop()
	evs := streamEvents(t, h.c, 0)
	pools, proxies := logNames(evs)
	last := evs[len(evs)-1].Seq
	want := observe(t, observer(t, h.c, foldEvents(evs, last)), pools, proxies)
	for _, k := range cutPoints(evs, 20) {
		st := roundTrip(t, foldEvents(evs, k))
		applyEvents(st, evs, k, last)
		diffObserved(t, fmt.Sprintf("snapshot at %d + tail", k), observe(t, observer(t, h.c, st), pools, proxies), want)
	}
}

// snapshotBytes returns a snapshot of the fold of evs up to k.
func snapshotBytes(t *testing.T, evs []bus.Event, k uint64, edit func(*image)) []byte {
	t.Helper()
	img := foldEvents(evs, k).image()
	if edit != nil {
		edit(img)
	}
	var buf bytes.Buffer
	if err := img.encode(&buf); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// putSnapshot stores body as the planner's snapshot with the metadata a
// writer of version version at sequence seq gives it, in chunks of chunk
// bytes (0: the default).
func (h *harness) putSnapshot(body []byte, version string, seq uint64, chunk uint32) *jetstream.ObjectInfo {
	h.t.Helper()
	ctx := context.Background()
	obs, err := h.c.JS.ObjectStore(ctx, bus.ObjectSnapshots)
	if err != nil {
		h.t.Fatal(err)
	}
	meta := jetstream.ObjectMeta{Name: snapshotObject,
		Metadata: map[string]string{metaVersion: version, metaSeq: fmt.Sprint(seq)}}
	if chunk > 0 {
		meta.Opts = &jetstream.ObjectMetaOptions{ChunkSize: chunk}
	}
	info, err := obs.Put(ctx, meta, bytes.NewReader(body))
	if err != nil {
		h.t.Fatal(err)
	}
	return info
}

// compareWithReplay checks that planner r answers as a full replay of the
// log up to r's sequence does. The log is quiet (no planner leads).
func (h *harness) compareWithReplay(r *running, what string) {
	h.t.Helper()
	h.folded(r)
	evs := streamEvents(h.t, h.c, 0)
	pools, proxies := logNames(evs)
	r.mu.Lock()
	seq := r.st.seq
	r.mu.Unlock()
	r.now = func() time.Time { return observedAt }
	want := observe(h.t, observer(h.t, h.c, foldEvents(evs, seq)), pools, proxies)
	diffObserved(h.t, what, observe(h.t, r.Planner, pools, proxies), want)
}

// TestStartFromSnapshotReplaysOnlyTheTail: a replica writes a snapshot;
// after more events, a new replica starts from it, replays only the events
// after it, and answers as a full replay does.
func TestStartFromSnapshotReplaysOnlyTheTail(t *testing.T) {
	h := newHarness(t)
	h.holdLease()
	g := newLogGen(t, h.c, 11)
	g.fill(3000)
	p1 := h.follower("p1")
	h.folded(p1)
	k, err := p1.snap.writeSnapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if last := h.streamSeq(bus.EventsStream); k != last {
		t.Fatalf("snapshot covers %d, want the stream's last sequence %d", k, last)
	}
	// Writing again with nothing new stores nothing new.
	if again, err := p1.snap.writeSnapshot(t.Context()); !errors.Is(err, errSnapshotSkipped) || again != k {
		t.Fatalf("second snapshot at the same sequence: got %d, %v; want %d, skipped", again, err, k)
	}
	g.fill(g.n + 1500)

	p2 := h.follower("p2")
	if p2.snap.loaded != k {
		t.Fatalf("p2 started from snapshot %d, want %d", p2.snap.loaded, k)
	}
	h.compareWithReplay(p2, "p2 (snapshot + tail)")
	h.compareWithReplay(p1, "p1 (full replay, then followed)")
}

// TestUnusableSnapshotFallsBackToFullReplay: a snapshot that is unreadable,
// incomplete, of another version, from the future, or from another stream
// is not loaded: the replica replays the whole log and answers as a full
// replay does.
func TestUnusableSnapshotFallsBackToFullReplay(t *testing.T) {
	h := newHarness(t)
	h.holdLease()
	g := newLogGen(t, h.c, 13)
	g.fill(1500)
	evs := streamEvents(t, h.c, 0)
	last := evs[len(evs)-1].Seq
	k := evs[len(evs)/2].Seq
	valid := snapshotBytes(t, evs, k, nil)
	version := fmt.Sprint(snapshotVersion)

	cases := []struct {
		name  string
		plant func()
	}{
		{"missing", func() {
			obs, err := h.c.JS.ObjectStore(t.Context(), bus.ObjectSnapshots)
			if err != nil {
				t.Fatal(err)
			}
			if err := obs.Delete(t.Context(), snapshotObject); err != nil && !errors.Is(err, jetstream.ErrObjectNotFound) {
				t.Fatal(err)
			}
		}},
		{"garbage", func() { h.putSnapshot([]byte("\x00\x01 not a snapshot"), version, k, 0) }},
		{"truncated", func() { h.putSnapshot(valid[:len(valid)/2], version, k, 0) }},
		{"unknown version in the info", func() { h.putSnapshot(valid, "999", k, 0) }},
		{"unknown version in the body", func() {
			h.putSnapshot(snapshotBytes(t, evs, k, func(img *image) { img.header.Version = 999 }), version, k, 0)
		}},
		{"from the future", func() {
			future := last + 1000
			h.putSnapshot(snapshotBytes(t, evs, k, func(img *image) { img.header.Seq = future }), version, future, 0)
		}},
		{"another stream's", func() {
			h.putSnapshot(snapshotBytes(t, evs, k, func(img *image) { img.header.Anchor.ID = "another-stream.requested.1" }), version, k, 0)
		}},
		{"the previous version's", func() {
			// Version 1 did not keep the autoscaled size.
			h.putSnapshot(snapshotBytes(t, evs, k, func(img *image) { img.header.Version = snapshotVersion - 1 }), fmt.Sprint(snapshotVersion-1), k, 0)
		}},
		{"a chunk lost", func() {
			info := h.putSnapshot(valid, version, k, 1024)
			h.dropChunk(info)
		}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.plant()
			rec := &logRecorder{}
			// A snapshot is due every 100 sequences (so a missing one is
			// worth a warning), but none is written during the test.
			r := h.startPlannerWith(Config{ID: fmt.Sprintf("r%d", i), SnapshotEvery: 100, SnapshotInterval: -1, KeepFinished: testKeep}, nil,
				func(p *Planner) { p.log, p.snap.kick = slog.New(rec), nil })
			if r.snap.loaded != 0 {
				t.Fatalf("loaded the %s snapshot (at %d), want a full replay", tc.name, r.snap.loaded)
			}
			if logs := rec.all(); !slices.Contains(logs, "WARN no usable planner snapshot; replaying the whole event log") {
				t.Errorf("warnings: got %q, want one saying the log is replayed", logs)
			}
			h.compareWithReplay(r, tc.name)
			r.stop()
		})
	}
	// The valid snapshot is loaded: the cases above failed for their fault
	// alone.
	h.putSnapshot(valid, version, k, 1024)
	r := h.follower("valid")
	if r.snap.loaded != k {
		t.Fatalf("valid snapshot: started from %d, want %d", r.snap.loaded, k)
	}
	h.compareWithReplay(r, "valid snapshot")
}

// dropChunk deletes one chunk of an object from its stream, as a storage
// fault would lose it.
func (h *harness) dropChunk(info *jetstream.ObjectInfo) {
	h.t.Helper()
	ctx := context.Background()
	s, err := h.c.JS.Stream(ctx, "OBJ_"+bus.ObjectSnapshots)
	if err != nil {
		h.t.Fatal(err)
	}
	m, err := s.GetLastMsgForSubject(ctx, "$O."+bus.ObjectSnapshots+".C."+info.NUID)
	if err != nil {
		h.t.Fatal(err)
	}
	// The chunk before the last one: the reader sees a short object.
	if err := s.DeleteMsg(ctx, m.Sequence-1); err != nil {
		h.t.Fatal(err)
	}
}

// TestSnapshotOfRecreatedStreamIsNotLoaded: after FLEET_EVENTS is deleted
// and recreated with another history longer than the snapshot's, the
// snapshot's sequence is within the stream but names another event: the
// replica replays the new log.
func TestSnapshotOfRecreatedStreamIsNotLoaded(t *testing.T) {
	h := newHarness(t)
	h.holdLease()
	newLogGen(t, h.c, 17).fill(800)
	p1 := h.follower("p1")
	k, err := p1.snap.writeSnapshot(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	p1.stop()
	if err := h.c.JS.DeleteStream(t.Context(), bus.EventsStream); err != nil {
		t.Fatal(err)
	}
	if err := bus.EnsureTopology(t.Context(), h.c); err != nil {
		t.Fatal(err)
	}
	newLogGen(t, h.c, 19).fill(1200)
	if last := h.streamSeq(bus.EventsStream); last <= k {
		t.Fatalf("the new history (%d events) must outgrow the snapshot (%d)", last, k)
	}
	p2 := h.follower("p2")
	if p2.snap.loaded != 0 {
		t.Fatalf("loaded the old stream's snapshot (at %d)", p2.snap.loaded)
	}
	h.compareWithReplay(p2, "after the stream was recreated")
}

// TestSnapshotsWrittenWhileEventsArrive: a replica writes snapshots on its
// own (every 1000 sequences) while events keep arriving; every snapshot it
// stored is exactly the fold of the log up to its sequence. (A read that
// races the next put fails its digest check and is retried.)
func TestSnapshotsWrittenWhileEventsArrive(t *testing.T) {
	h := newHarness(t)
	h.holdLease()
	r := h.startPlannerWith(Config{ID: "writer", SnapshotEvery: 1000, SnapshotInterval: -1, KeepFinished: testKeep}, nil)
	obs, err := h.c.JS.ObjectStore(t.Context(), bus.ObjectSnapshots)
	if err != nil {
		t.Fatal(err)
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	g := newLogGen(t, h.c, 23)
	wg.Go(func() {
		for g.n < 1_000_000 && !g.failed {
			select {
			case <-stop:
				return
			default:
			}
			for range 20 {
				g.step()
			}
			g.flush()
		}
	})
	var once sync.Once
	halt := func() { once.Do(func() { close(stop); wg.Wait() }) }
	// Registered after the server's cleanup, so it runs before it.
	t.Cleanup(halt)
	taken := map[uint64][]byte{}
	h.waitFor("three snapshots written while events arrive", func() bool {
		info, err := obs.GetInfo(t.Context(), snapshotObject)
		if err != nil {
			return false
		}
		var seq uint64
		fmt.Sscan(info.Metadata[metaSeq], &seq)
		if _, ok := taken[seq]; !ok {
			if b, err := obs.GetBytes(t.Context(), snapshotObject); err == nil {
				var hd snapHeader
				if json.NewDecoder(bytes.NewReader(b)).Decode(&hd) == nil {
					taken[hd.Seq] = b
				}
			}
		}
		return len(taken) >= 3
	})
	halt()
	if g.failed {
		t.FailNow()
	}
	h.folded(r)
	evs := streamEvents(t, h.c, 0)
	pools, proxies := logNames(evs)
	for seq, b := range taken {
		st, err := decodeSnapshot(bytes.NewReader(b), testLogger(), testKeep)
		if err != nil {
			t.Fatalf("snapshot at %d: %v", seq, err)
		}
		diffObserved(t, fmt.Sprintf("snapshot written at %d", seq),
			observe(t, observer(t, h.c, st), pools, proxies), observe(t, observer(t, h.c, foldEvents(evs, seq)), pools, proxies))
	}
}

// mixedActivity has a leader reconcile through pools applied, scaled,
// rolled and deleted; proxies brought up by the test's agent and health
// stand-ins and reported deleted; a ban, a recycle, an abandoned proxy, an
// agent's quota and terminated failures, an unhealthy proxy replaced and a
// rotation. It returns the leader once every pool settled.
func (h *harness) mixedActivity() *running {
	h.t.Helper()
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.agent(agent.Info{Entry: "local", Target: "t2"})
	var skew atomic.Int64
	r := h.skewedLeader("mixed", &skew, Config{})
	d := &driver{h: h, done: map[string]bool{}}
	a := h.readyPool(r, d, `{"name":"a","provider":"local","size":3,"maxAge":"1m","unhealthyAfter":"10s"}`, "a", 3)
	b := h.readyPool(r, d, `{"name":"b","provider":"local","size":3}`, "b", 3)
	c := h.readyPool(r, d, `{"name":"c","provider":"local","size":2}`, "c", 2)
	settled := func(what string, sizes map[string]int) {
		h.t.Helper()
		h.waitFor(what, func() bool {
			d.step()
			for name, n := range sizes {
				v := r.poolView(name)
				if v.States[events.ProxyReady] != n || v.Active != n {
					return false
				}
			}
			return true
		})
	}
	h.ok(poolApply, `{"name":"a","provider":"local","size":4,"maxAge":"1m","unhealthyAfter":"10s"}`, nil)
	h.ok(poolApply, `{"name":"b","provider":"local","size":2}`, nil)
	settled("scaled", map[string]int{"a": 4, "b": 2})

	h.ok(proxyReportBan, `{"id":"`+a[0]+`","reason":"403 from example.com"}`, nil)
	h.ok(proxyRecycle, `{"id":"`+c[0]+`"}`, nil)
	h.ok(proxyDelete, `{"id":"`+c[1]+`","skipCleanup":true}`, nil)
	settled("ban, recycle, abandon", map[string]int{"a": 4, "c": 2})

	// The agent says the backend lost one proxy and refused another.
	var live []string
	for _, x := range r.proxies("b") {
		live = append(live, x.ID)
	}
	h.observe(live[0], events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassTerminated, Reason: "instance terminated", Attempt: 1})
	h.observe(live[1], events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassQuota, Reason: "quota", Attempt: 1})
	settled("failures replaced", map[string]int{"b": 2})

	// One proxy turns unhealthy and stays so: it is replaced.
	sick := r.proxies("a")[1].ID
	h.observe(sick, events.ProxyUnhealthy, 1, events.ProxyUnhealthyData{Reason: "probe: timeout", Streak: 3})
	h.waitState(r, sick, events.ProxyUnhealthy)
	skew.Store(int64(11 * time.Second))
	settled("unhealthy replaced", map[string]int{"a": 4})

	// Every proxy of a is past maxAge: rotated one at a time. b rolls.
	originals := map[string]bool{}
	for _, x := range r.proxies("a") {
		originals[x.ID] = true
	}
	skew.Store(int64(2 * time.Minute))
	h.ok(poolApply, `{"name":"b","provider":"local","size":2,"port":3129}`, nil)
	h.waitFor("rotated and rolled", func() bool {
		d.step()
		for _, x := range r.proxies("a") {
			if originals[x.ID] {
				return false
			}
		}
		v := r.poolView("b")
		return v.Outdated == 0 && v.States[events.ProxyReady] == 2 && v.Active == 2
	})
	// Proxies created under the skewed clock are aged too: stop the clock
	// there so the rotation ends.
	skew.Store(0)
	settled("rotation over", map[string]int{"a": 4, "b": 2})
	h.ok(poolDelete, `{"name":"c"}`, nil)
	h.waitFor("c emptied", func() bool {
		d.step()
		return len(r.proxies("c")) == 0
	})
	_ = b
	h.settle(r, 3)
	return r
}

// proxies returns the live members of a pool of r's projection, oldest
// first.
func (r *running) proxies(pool string) []Proxy {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Proxy
	if p := r.st.pools[pool]; p != nil {
		for _, x := range p.members {
			if decide.IsActive(x.State) {
				out = append(out, *x)
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out
}

// checkLoad fails t when the load the state keeps per target differs from
// a count of its live proxies.
func checkLoad(t *testing.T, st *state) {
	t.Helper()
	all, per := map[string]int{}, map[string]map[string]int{}
	for _, pl := range st.pools {
		per[pl.Name] = map[string]int{}
		for _, x := range pl.members {
			if decide.IsActive(x.State) {
				k := targetKey(x.Entry, x.Target)
				all[k]++
				per[pl.Name][k]++
			}
		}
	}
	if fmt.Sprint(all) != fmt.Sprint(st.onTarget) {
		t.Fatalf("load per target: kept %v, counted %v", st.onTarget, all)
	}
	for _, pl := range st.pools {
		if fmt.Sprint(per[pl.Name]) != fmt.Sprint(pl.onTarget) {
			t.Fatalf("pool %s load per target: kept %v, counted %v", pl.Name, pl.onTarget, per[pl.Name])
		}
	}
}

// TestPlannerStopsCleanlyAtAnyPointOfStartUp: a planner stopped at any
// moment of its start-up (loading a snapshot, replaying, starting its
// watches, taking the lease), by its context ending or by the NATS
// server shutting down under it and then its context ending, returns from
// Run instead of panicking (a watch that failed to start once made it
// stop a nil watcher) or hanging.
func TestPlannerStopsCleanlyAtAnyPointOfStartUp(t *testing.T) {
	for _, mode := range []string{"context", "server"} {
		for _, after := range []time.Duration{0, time.Millisecond, 2 * time.Millisecond, 5 * time.Millisecond, 10 * time.Millisecond,
			20 * time.Millisecond, 50 * time.Millisecond, 100 * time.Millisecond, 250 * time.Millisecond, 600 * time.Millisecond} {
			t.Run(fmt.Sprintf("%s after %s", mode, after), func(t *testing.T) {
				h := newHarness(t)
				h.agent(agent.Info{Entry: "local", Target: "t1", Type: "local", Capacity: 10})
				p, err := New(bustest.Dial(t, h.c), Config{ID: "p1", ReconcileInterval: 100 * time.Millisecond, LeaseTTL: 3 * time.Second}, testLogger(), nil, nil)
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				done := make(chan error, 1)
				go func() { done <- p.Run(ctx) }()
				time.Sleep(after) // the point of start-up to stop at
				if mode == "server" {
					h.c.Server.Shutdown()
					time.Sleep(50 * time.Millisecond) // let the planner meet the dead server
				}
				cancel()
				select {
				case err := <-done:
					// An error (the server gone) is a clean exit too.
					if err != nil {
						t.Logf("Run returned %v", err)
					}
				case <-time.After(30 * time.Second):
					var stacks strings.Builder
					_ = pprof.Lookup("goroutine").WriteTo(&stacks, 1)
					t.Fatalf("Run did not return within 30s of its context ending; goroutines:\n%s", stacks.String())
				}
			})
		}
	}
}
