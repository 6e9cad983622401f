package probe_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/health/internal/echo"
	"proxyfleet/services/health/internal/probe"
	"proxyfleet/services/health/internal/projection"
)

// replica is one health prober of a test, with its own echo endpoint: a
// forward proxy tells which replica probed it by the host it was asked for.
type replica struct {
	id   string
	host string // its echo endpoint's host:port
	pr   *probe.Prober
	stop context.CancelFunc
	done chan error
}

const (
	replicaInterval = time.Second
	replicaBeat     = 100 * time.Millisecond
	replicaTimeout  = 2 * time.Second
)

func startReplica(t *testing.T, f *fleet, id string, log *slog.Logger) *replica {
	t.Helper()
	echoSrv := httptest.NewServer(echo.Handler())
	t.Cleanup(echoSrv.Close)
	u, _ := url.Parse(echoSrv.URL)
	pr, err := probe.New(f.conn, probe.Config{
		EchoURL: echoSrv.URL + "/", Interval: replicaInterval, Timeout: replicaTimeout,
		Concurrency: 4, UnhealthyAfter: unhealthyAfter, Key: f.key, Replica: id, Beat: replicaBeat,
	}, log, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(f.ctx)
	r := &replica{id: id, host: u.Host, pr: pr, stop: cancel, done: make(chan error, 1)}
	go func() { r.done <- pr.Run(ctx) }()
	t.Cleanup(func() { r.halt(t) })
	return r
}

// replicaFleet starts an embedded NATS server and a fleet on it whose
// logs, at level, go to the returned buffer; with project, a projector
// keeps the views as health does. The fleet's context ends after timeout.
func replicaFleet(t *testing.T, timeout time.Duration, level slog.Level, project bool) (*fleet, *slog.Logger, *testwait.Buffer) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	t.Cleanup(cancel)
	c := bustest.Start(t)
	key, err := seal.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	logs := &testwait.Buffer{}
	log := slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: level}))
	f := &fleet{t: t, ctx: ctx, conn: c, store: bus.NewEventStore(c, "test", nil), logs: logs, key: key}
	if project {
		pctx, pstop := context.WithCancel(ctx)
		var wg sync.WaitGroup
		wg.Go(func() { _ = projection.New(c, log, nil).Run(pctx) })
		t.Cleanup(func() { pstop(); wg.Wait() })
	}
	return f, log, logs
}

// halt stops the replica and waits for its Run to end.
func (r *replica) halt(t *testing.T) {
	r.stop()
	if r.done == nil {
		return
	}
	if err := <-r.done; err != nil {
		t.Errorf("replica %s: %v", r.id, err)
	}
	r.done = nil
}

// probedBy counts, per proxy, the requests each replica sent through it.
func probedBy(proxies map[string]*fwdProxy, rs ...*replica) map[string]map[string]int {
	out := map[string]map[string]int{}
	for id, fp := range proxies {
		out[id] = map[string]int{}
		for _, r := range rs {
			out[id][r.id] = fp.requestsFor(r.host)
		}
	}
	return out
}

// watchMembers polls the members each replica sees until the returned
// function is called, which says what a replica saw other than want, ""
// when nothing.
func watchMembers(want []string, rs ...*replica) func() string {
	stop := make(chan struct{})
	seen := make(chan string, 1)
	go func() {
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			for _, r := range rs {
				if got := r.pr.Members(); !slices.Equal(got, want) {
					seen <- fmt.Sprintf("%s saw members %v", r.id, got)
					return
				}
			}
			select {
			case <-stop:
				seen <- ""
				return
			case <-t.C:
			}
		}
	}()
	return func() string {
		close(stop)
		return <-seen
	}
}

// Two health replicas split the proxies: in steady state each proxy is
// probed by exactly the replica the assignment names, the shared egress
// counts the proxies of both, and when one replica
// dies without leaving (its key simply stops being renewed) the survivor
// probes all its proxies within the membership TTL plus one probe interval.
func TestReplicasSplitTheProbing(t *testing.T) {
	f, log, logs := replicaFleet(t, 90*time.Second, slog.LevelDebug, true)

	const n = 16
	proxies := map[string]*fwdProxy{}
	for i := range n {
		id := fmt.Sprintf("demo-%02d", i)
		proxies[id] = newFwdProxy(t, "127.0.0.1", "", "")
		f.runningProxy(id, "demo", "", proxies[id].addr)
	}

	a := startReplica(t, f, "health-a", log)
	for id := range proxies {
		f.waitState(id, events.ProxyReady)
	}
	b := startReplica(t, f, "health-b", log)
	both := []string{"health-a", "health-b"}
	f.eventually("both replicas seeing each other", func() bool {
		return slices.Equal(a.pr.Members(), both) && slices.Equal(b.pr.Members(), both)
	})

	// morePerProxy waits until every proxy in ids was asked for k more
	// requests by the replicas rs than in from.
	morePerProxy := func(ids []string, from map[string]map[string]int, k int, rs ...*replica) {
		t.Helper()
		f.eventually(fmt.Sprintf("%d more probes of each proxy", k), func() bool {
			now := probedBy(proxies, rs...)
			for _, id := range ids {
				more := 0
				for _, r := range rs {
					more += now[id][r.id] - from[id][r.id]
				}
				if more < k {
					return false
				}
			}
			return true
		})
	}
	all := slices.Sorted(func(yield func(string) bool) {
		for id := range proxies {
			if !yield(id) {
				return
			}
		}
	})
	// Let probes started before the handover end, then watch a steady
	// state of several probes of every proxy. A window counts only if
	// both replicas saw both as members throughout: on a loaded machine a
	// renewal can come later than the membership TTL, and then, by
	// design, the other replica takes the late one's proxies over for a
	// beat. Such a window is measured again.
	//
	// Two witnesses, because a poll alone can miss a beat-long change on
	// a starved machine: the members each replica reports, polled, and
	// the replicas' own log of every change of members. The log must show
	// no change from before the window's lead-in, and the lead-in lasts
	// at least a probe's timeout, so a probe begun by an earlier owner
	// has ended before the window opens.
	changes := func() int { return strings.Count(logs.String(), `"msg":"health replicas changed"`) }
	var before, after map[string]map[string]int
	for attempt := 1; ; attempt++ {
		quiet := changes()
		leadIn := time.Now()
		unsteady := watchMembers(both, a, b)
		morePerProxy(all, probedBy(proxies, a, b), 2, a, b)
		time.Sleep(time.Until(leadIn.Add(replicaTimeout)))
		before = probedBy(proxies, a, b)
		morePerProxy(all, before, 6, a, b) // a probe is two requests
		after = probedBy(proxies, a, b)
		seen := unsteady()
		if n := changes() - quiet; seen == "" && n > 0 {
			seen = fmt.Sprintf("the replicas logged %d changes of members", n)
		}
		if seen == "" {
			break
		}
		if attempt == 10 {
			t.Fatalf("no steady window in %d attempts; the last: %s", attempt, seen)
		}
		t.Logf("window %d not steady (%s); measuring again", attempt, seen)
	}
	owned := map[string][]string{}
	for _, id := range all {
		want := probe.Owner(id, both)
		owned[want] = append(owned[want], id)
		for _, r := range []*replica{a, b} {
			more := after[id][r.id] - before[id][r.id]
			if r.id == want && more == 0 {
				t.Errorf("%s: its owner %s did not probe it", id, want)
			}
			if r.id != want && more != 0 {
				t.Errorf("%s: %s probed it (%d requests) though %s owns it", id, r.id, more, want)
			}
		}
	}
	if len(owned["health-a"]) == 0 || len(owned["health-b"]) == 0 {
		t.Fatalf("the assignment gave one replica nothing: %v", owned)
	}
	if t.Failed() {
		t.FailNow()
	}
	// All proxies egress from 127.0.0.1: each record counts the 15 others,
	// half of them probed by the other replica.
	f.eventually("every record counting the whole fleet's shared egress", func() bool {
		for _, id := range all {
			if r := f.record(id); r.EgressIP != "127.0.0.1" || r.SharedEgress != n-1 {
				return false
			}
		}
		return true
	})

	// b dies: no leave, its key just stops being renewed.
	b.pr.KeepMembershipOnExit()
	b.halt(t)
	died := time.Now()
	fromB := probedBy(proxies, a, b)
	morePerProxy(owned["health-b"], fromB, 2, a)
	took := time.Since(died)
	// By design the survivor takes over within the membership TTL plus a
	// probe interval (4 s). A busy machine delays the server's expiry of
	// the key, the watch and the probes by seconds (6 s seen at load 5),
	// so the bound is four times that: still far below the fleet's
	// unhealthyAfter (90 s), which a takeover that waited for anything
	// but the membership's expiry would take.
	design := bus.HealthMemberTTL + replicaInterval
	bound := 4 * design
	t.Logf("%d proxies of the dead replica probed by the survivor %s after it died (by design within %s; bound %s)", len(owned["health-b"]), took.Round(time.Millisecond), design, bound)
	if took > bound {
		t.Errorf("the survivor took %s to probe the dead replica's proxies; want within 4 × (the membership TTL + a probe interval) = %s", took, bound)
	}
	if got := a.pr.Members(); !slices.Equal(got, []string{"health-a"}) {
		t.Errorf("survivor's members: %v, want only itself", got)
	}
	now := probedBy(proxies, a, b)
	for _, id := range all {
		if now[id]["health-b"] != fromB[id]["health-b"] {
			t.Errorf("%s probed through the dead replica's echo after it stopped", id)
		}
	}
}

// Two replicas given one id both own every proxy; each notices the other
// writing its key and says so.
func TestReplicasWithOneIDAreReported(t *testing.T) {
	f, log, logs := replicaFleet(t, 60*time.Second, slog.LevelInfo, false)
	startReplica(t, f, "health-x", log)
	startReplica(t, f, "health-x", log)
	f.eventually("the clash of replica ids logged", func() bool {
		return strings.Contains(logs.String(), "give each replica its own --replica-id")
	})
}

// A replica without the fleet-health bucket (a topology from before it)
// refuses to start and names the command that creates it.
func TestReplicaWithoutTheBucketNamesBootstrap(t *testing.T) {
	ctx := testwait.Context(t, 30*time.Second)
	c := bustest.Start(t)
	if err := c.JS.DeleteKeyValue(ctx, bus.BucketHealth); err != nil {
		t.Fatal(err)
	}
	pr, err := probe.New(c, probe.Config{EchoURL: "http://127.0.0.1:1/", Replica: "health-a"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = pr.Run(ctx)
	if err == nil || !strings.Contains(err.Error(), bus.BucketHealth) || !strings.Contains(err.Error(), "planner bootstrap") {
		t.Fatalf("Run: got %v, want an error naming %s and planner bootstrap", err, bus.BucketHealth)
	}
}

// A replica taking a failing proxy over continues the failure streak the
// previous owner recorded, and the proxy's unhealthy event stays the one.
func TestTakeoverContinuesTheStreak(t *testing.T) {
	f, log, _ := replicaFleet(t, 90*time.Second, slog.LevelDebug, true)

	both := []string{"health-a", "health-b"}
	// A proxy id health-b owns.
	id := ""
	for i := 0; id == ""; i++ {
		if cand := fmt.Sprintf("demo-%02d", i); probe.Owner(cand, both) == "health-b" {
			id = cand
		}
	}
	fp := newFwdProxy(t, "127.0.0.1", "", "")
	f.runningProxy(id, "demo", "", fp.addr)
	a := startReplica(t, f, "health-a", log)
	b := startReplica(t, f, "health-b", log)
	f.eventually("both replicas seeing each other", func() bool {
		return slices.Equal(a.pr.Members(), both) && slices.Equal(b.pr.Members(), both)
	})
	f.waitState(id, events.ProxyReady)
	fp.stop()
	f.waitState(id, events.ProxyUnhealthy)
	f.eventually("a streak past the threshold", func() bool { return f.record(id).Streak > unhealthyAfter })

	b.pr.KeepMembershipOnExit()
	b.halt(t)
	last := f.record(id) // b's last record: b wrote it, and writes no more
	f.eventually("the survivor's first probe of "+id, func() bool { return f.record(id).CheckedAt.After(last.CheckedAt) })
	if got := f.record(id); got.Streak != last.Streak+1 {
		t.Fatalf("the survivor's first record has streak %d; want the dead replica's %d continued: %d", got.Streak, last.Streak, last.Streak+1)
	}
	if n := len(f.kinds(id)[events.ProxyUnhealthy]); n != 1 {
		t.Fatalf("unhealthy events: %d, want 1", n)
	}
}

// A replica whose joining fails for a while (here the fleet-health bucket
// refuses every write, as a cluster electing leaders would fail them)
// keeps trying, and once the writes go through it joins and probes: a
// start-up during a node's loss must not end the replica.
func TestReplicaJoinsOnceTheBucketTakesWrites(t *testing.T) {
	f, log, logs := replicaFleet(t, 60*time.Second, slog.LevelInfo, true)
	ctx, c := f.ctx, f.conn

	// Every write to the bucket is refused: a member value is far larger
	// than 8 bytes.
	st, err := c.JS.Stream(ctx, "KV_"+bus.BucketHealth)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	limited := cfg
	limited.MaxMsgSize = 8
	if _, err := c.JS.UpdateStream(ctx, limited); err != nil {
		t.Fatal(err)
	}
	fp := newFwdProxy(t, "127.0.0.1", "", "")
	f.runningProxy("demo-1", "demo", "", fp.addr)
	r := startReplica(t, f, "health-a", log)
	f.eventually("the failed join logged", func() bool {
		select {
		case err := <-r.done:
			r.done = nil
			t.Fatalf("the replica ended while it could not join: %v", err)
		default:
		}
		return strings.Contains(logs.String(), "prober start failed; retrying")
	})
	if _, err := c.JS.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	f.eventually("the replica a member", func() bool { return slices.Equal(r.pr.Members(), []string{"health-a"}) })
	f.waitState("demo-1", events.ProxyReady)
	if n := fp.requestsFor(r.host); n == 0 {
		t.Fatal("the proxy turned ready without a probe through it by the replica")
	}
}

// A replica whose watch of the proxies view fails (its bucket gone for a
// while, as a cluster electing leaders fails it) watches again, and
// probes what the view holds once it is back: it does not sit on its
// membership without probing.
func TestReplicaWatchesAgainAfterTheViewFails(t *testing.T) {
	f, log, logs := replicaFleet(t, 90*time.Second, slog.LevelInfo, true)
	ctx, c := f.ctx, f.conn

	r := startReplica(t, f, "health-a", log)
	f.eventually("the replica a member", func() bool { return slices.Equal(r.pr.Members(), []string{"health-a"}) })
	if err := c.JS.DeleteKeyValue(ctx, bus.BucketProxies); err != nil {
		t.Fatal(err)
	}
	f.eventually("the failed watch logged", func() bool {
		select {
		case err := <-r.done:
			r.done = nil
			t.Fatalf("the replica ended when its watch failed: %v", err)
		default:
		}
		return strings.Contains(logs.String(), "watch of the proxies view failed; watching again")
	})
	// The view back, as a rebuild makes it: the replica probes its proxy.
	if err := bus.EnsureTopology(ctx, c); err != nil {
		t.Fatal(err)
	}
	fp := newFwdProxy(t, "127.0.0.1", "", "")
	f.runningProxy("demo-1", "demo", "", fp.addr)
	f.waitState("demo-1", events.ProxyReady)
	if n := fp.requestsFor(r.host); n == 0 {
		t.Fatal("the proxy turned ready without a probe through it by the replica")
	}
}
