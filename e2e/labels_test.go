package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testgate"
)

// labelledAgent is one local agent of a labelled fleet: its target, its
// --labels, the loopback address its proxies connect out from (so a site
// tells the agents' proxies apart) and its state directory.
type labelledAgent struct {
	target, labels, source string
	stateDir               string
}

// agentName is the fleet's process name of a's agent.
func (a *labelledAgent) agentName() string { return "agent-" + a.target }

// needLoopbackSources skips the test (or fails it under
// PROXYFLEET_REQUIRE_INTEGRATION=1) unless the kernel lets a socket bind
// each of addrs: Linux routes all of 127.0.0.0/8 to the loopback
// interface, other systems may not.
func needLoopbackSources(t *testing.T, addrs ...string) {
	t.Helper()
	for _, a := range addrs {
		l, err := net.Listen("tcp", net.JoinHostPort(a, "0"))
		testgate.Need(t, err == nil, fmt.Sprintf("a socket bound to %s (the proxies' source addresses; Linux routes 127.0.0.0/8 to lo): %v", a, err))
		l.Close()
	}
}

// startLabelledFleet is NATS, the planner, health and one local agent per
// entry of agents (all of entry local), each announcing its labels; their
// proxies may reach the servers of allowed. The fleet shows every
// process's log when the test fails, and no proxy of these agents
// outlives the test.
func startLabelledFleet(t *testing.T, agents []*labelledAgent, allowed ...*httptest.Server) *fleet {
	t.Helper()
	var sources []string
	for _, a := range agents {
		sources = append(sources, a.source)
	}
	needLoopbackSources(t, sources...)
	f := newFleet(t)
	for _, srv := range allowed {
		f.allow(srv)
	}
	t.Cleanup(func() {
		for _, a := range agents {
			for _, pid := range proxyProcesses(agentExe(), a.stateDir) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		names := []string{"planner", "health", "gateway"}
		for _, a := range agents {
			names = append(names, a.agentName())
		}
		for _, n := range names {
			l := f.log(n)
			if len(l) > 5000 {
				l = l[len(l)-5000:]
			}
			t.Logf("---- %s log (tail) ----\n%s", n, l)
		}
	})
	f.startPlanner()
	f.startHealth()
	for _, a := range agents {
		a.stateDir = t.TempDir()
		f.startLabelledAgent(a)
	}
	for _, a := range agents {
		f.waitAgent("local", a.target)
	}
	f.waitLeader()
	return f
}

// startLabelledAgent starts a's local agent (again, after a stop: its
// state directory finds its proxies).
func (f *fleet) startLabelledAgent(a *labelledAgent) {
	f.t.Helper()
	args := []string{"--entry", "local", "--target", a.target, "--state-dir", a.stateDir,
		"--ports", "0", "--capacity", "40", "--labels", a.labels, "--source-addrs", a.source,
		"--egress-allow", f.echoEndpoint()}
	f.startBinary(a.agentName(), agentExe(), nil, append(args, f.agentArg...)...)
}

// placedView is the part of a fleet-proxies value these tests read:
// where a proxy runs, its target's labels, the egress address health saw,
// and what replaces it.
type placedView struct {
	ID            string            `json:"id"`
	Pool          string            `json:"pool"`
	State         string            `json:"state"`
	Target        string            `json:"target"`
	Address       string            `json:"address"`
	Labels        map[string]string `json:"labels"`
	EgressIP      string            `json:"egressIP"`
	Replaces      string            `json:"replaces"`
	ReplacedBy    string            `json:"replacedBy"`
	ReplaceReason string            `json:"replaceReason"`
}

// placed is the views of pool's proxies.
func (f *fleet) placed(pool string) []placedView {
	f.t.Helper()
	var out []placedView
	for _, raw := range f.views(bus.BucketProxies) {
		var v placedView
		if err := json.Unmarshal(raw, &v); err != nil {
			f.t.Fatalf("fleet-proxies value is not JSON: %s", raw)
		}
		if v.Pool == pool {
			out = append(out, v)
		}
	}
	return out
}

// isActive reports whether a proxy in state s counts toward its pool's
// size (as the planner counts: requested to unhealthy).
func isActive(s string) bool {
	switch s {
	case events.ProxyRequested, events.ProxyProvisioning, events.ProxyRunning, events.ProxyReady, events.ProxyUnhealthy:
		return true
	}
	return false
}

// spreadOf counts the active proxies of vs by their label key, and
// reports whether every one of them is ready.
func spreadOf(vs []placedView, key string) (map[string]int, bool) {
	counts := map[string]int{}
	allReady := true
	for _, v := range vs {
		if !isActive(v.State) {
			continue
		}
		counts[v.Labels[key]]++
		allReady = allReady && v.State == events.ProxyReady
	}
	return counts, allReady
}

// activeWatch follows every change of fleet-proxies for one pool and
// keeps the most proxies that were active at once, per phase of a test,
// and the replace reasons it saw.
type activeWatch struct {
	mu      sync.Mutex
	states  map[string]string
	phase   string
	most    map[string]int // phase → most active at once
	reasons map[string]string
}

// watchActive starts an [activeWatch] of pool in phase; it stops with the
// test.
func (f *fleet) watchActive(pool, phase string) *activeWatch {
	f.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	f.t.Cleanup(cancel)
	kv, err := f.conn.JS.KeyValue(ctx, bus.BucketProxies)
	if err != nil {
		f.t.Fatal(err)
	}
	w, err := kv.WatchAll(ctx)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { _ = w.Stop() })
	aw := &activeWatch{states: map[string]string{}, phase: phase, most: map[string]int{}, reasons: map[string]string{}}
	go func() {
		for e := range w.Updates() {
			if e == nil {
				continue // the end of the initial values
			}
			var v placedView
			if e.Operation() == jetstream.KeyValuePut {
				if json.Unmarshal(e.Value(), &v) != nil || v.Pool != pool {
					continue
				}
			}
			aw.note(e.Key(), v)
		}
	}()
	return aw
}

func (aw *activeWatch) note(key string, v placedView) {
	aw.mu.Lock()
	defer aw.mu.Unlock()
	if isActive(v.State) {
		aw.states[key] = v.State
	} else {
		delete(aw.states, key)
	}
	if v.ReplacedBy != "" {
		aw.reasons[v.ID] = v.ReplaceReason
	}
	if n := len(aw.states); n > aw.most[aw.phase] {
		aw.most[aw.phase] = n
	}
}

// enter starts phase: from now on the most active proxies count for it.
func (aw *activeWatch) enter(phase string) {
	aw.mu.Lock()
	defer aw.mu.Unlock()
	aw.phase = phase
	aw.most[phase] = len(aw.states)
}

// mostIn is the most proxies that were active at once in phase.
func (aw *activeWatch) mostIn(phase string) int {
	aw.mu.Lock()
	defer aw.mu.Unlock()
	return aw.most[phase]
}

// replaceReasons is every replace reason seen so far, by replaced proxy.
func (aw *activeWatch) replaceReasons() map[string]string {
	aw.mu.Lock()
	defer aw.mu.Unlock()
	out := map[string]string{}
	for k, v := range aw.reasons {
		out[k] = v
	}
	return out
}

// poolCondition is pool's condition of type typ as pool.get shows it.
func (f *fleet) poolCondition(pool, typ string) events.Condition {
	f.t.Helper()
	pv := must(f.t, "pool.get "+pool, func(ctx context.Context) (api.PoolView, error) { return f.api.PoolGet(ctx, pool) })
	c, _ := events.FindCondition(pv.Conditions, typ)
	return c
}

// TestSpreadOverLabelledTargets is issue 28's placement acceptance on
// real processes: three local agents labelled region=eu, us and ap, each
// egressing from its own loopback address, and a pool of 10 spread
// 50/30/20 over region: 5/3/2 ready, each proxy egressing from its
// region's address. The ap agent is stopped and its proxies killed: the
// pool returns to 10 ready on eu and us, and Placed names region=ap as
// what is short. The ap agent restarts: the planner moves the spread back
// to 5/3/2, surge first, one move at a time ("rebalance" replacements),
// never holding more than size+1 = 11 active proxies.
//
// While ap's two proxies are dead, each gets its own replacement (heal's
// rule: a pool holds at most size plus its sick proxies), so that phase
// is held to size+2.
func TestSpreadOverLabelledTargets(t *testing.T) {
	eu := &labelledAgent{target: "t-eu", labels: "region=eu", source: "127.0.0.2"}
	us := &labelledAgent{target: "t-us", labels: "region=us", source: "127.0.0.3"}
	ap := &labelledAgent{target: "t-ap", labels: "region=ap", source: "127.0.0.4"}
	f := startLabelledFleet(t, []*labelledAgent{eu, us, ap})
	const size = 10
	watch := f.watchActive("geo", "fill")
	f.apply(events.PoolSpec{Name: "geo", Provider: "local", Size: size, UnhealthyAfter: events.Duration(10 * time.Second),
		Placement: &events.Placement{Spread: []events.Spread{{Label: "region", Weights: map[string]int{"eu": 50, "us": 30, "ap": 20}}}}})

	want := map[string]int{"eu": 5, "us": 3, "ap": 2}
	// waitActive waits until every active proxy of the pool is ready and
	// their count by region satisfies ok; it returns the pool's views.
	waitActive := func(what string, within time.Duration, ok func(map[string]int) bool) ([]placedView, map[string]int) {
		t.Helper()
		var got map[string]int
		var vs []placedView
		waitFor(t, within, what, func() bool {
			vs = f.placed("geo")
			var ready bool
			got, ready = spreadOf(vs, "region")
			return ready && ok(got)
		})
		return vs, got
	}
	exactly := func(want map[string]int) func(map[string]int) bool {
		return func(got map[string]int) bool { return fmt.Sprint(got) == fmt.Sprint(want) }
	}
	vs, _ := waitActive("5/3/2 ready over eu/us/ap", 90*time.Second, exactly(want))
	// Each proxy egresses from its agent's address, as health observed.
	source := map[string]string{"eu": eu.source, "us": us.source, "ap": ap.source}
	waitFor(t, 30*time.Second, "every proxy's egressIP observed", func() bool {
		vs = f.placed("geo")
		for _, v := range vs {
			if isActive(v.State) && v.EgressIP == "" {
				return false
			}
		}
		return true
	})
	for _, v := range vs {
		if isActive(v.State) && v.EgressIP != source[v.Labels["region"]] {
			t.Errorf("proxy %s (target %s, labels %v) egresses from %q; want %s", v.ID, v.Target, v.Labels, v.EgressIP, source[v.Labels["region"]])
		}
	}
	if n := watch.mostIn("fill"); n > size {
		t.Errorf("the fill held %d active proxies at once; want at most %d", n, size)
	}

	// The ap target goes away: its agent stops, then its proxies die.
	watch.enter("heal")
	f.stop(ap.agentName())
	apProcs := proxyProcesses(agentExe(), ap.stateDir)
	if len(apProcs) != 2 {
		t.Fatalf("ap's stopped agent left %d proxy processes; want its 2 proxies", len(apProcs))
	}
	for _, pid := range apProcs {
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	}
	// The replacements keep the spread where the targets allow it: eu
	// and us keep their shares and take ap's between them.
	_, got := waitActive("10 ready on eu and us", 120*time.Second, func(got map[string]int) bool {
		return got["eu"]+got["us"] == size && len(got) == 2
	})
	if got["eu"] < want["eu"] || got["us"] < want["us"] || got["eu"] <= got["us"] {
		t.Errorf("without ap the pool holds %v; want eu and us each at least their share (5, 3) and eu above us", got)
	}
	if n := watch.mostIn("heal"); n > size+2 {
		t.Errorf("healing ap's 2 dead proxies held %d active proxies at once; want at most %d (one replacement each)", n, size+2)
	}
	t.Logf("without ap: %v; most active at once while healing: %d", got, watch.mostIn("heal"))
	// Placed names what is short. Checked without stopping the test, so
	// the return below is seen either way.
	var placed events.Condition
	deadline := time.Now().Add(20 * time.Second)
	for {
		placed = f.poolCondition("geo", events.ConditionPlaced)
		if strings.Contains(placed.Message, "region=ap") || time.Now().After(deadline) {
			break
		}
		time.Sleep(300 * time.Millisecond)
	}
	if !strings.Contains(placed.Message, "region=ap") {
		t.Errorf("without ap, Placed is %s %s %q; want its message to name region=ap as short of its share", placed.Status, placed.Reason, placed.Message)
	}

	// ap returns: the spread returns to 5/3/2, surge first, one move at
	// a time.
	watch.enter("return")
	f.startLabelledAgent(ap)
	f.waitAgent("local", ap.target)
	waitActive("the spread back at 5/3/2", 180*time.Second, exactly(want))
	if n := watch.mostIn("return"); n > size+1 {
		t.Errorf("the return to 5/3/2 held %d active proxies at once; want at most size+1 = %d", n, size+1)
	}
	rebalanced := 0
	for id, why := range watch.replaceReasons() {
		if strings.HasPrefix(why, "rebalance") {
			rebalanced++
			t.Logf("%s replaced: %s", id, why)
		}
	}
	if rebalanced < 2 {
		t.Errorf("%d proxies were replaced with a reason starting \"rebalance\" (%v); want the 2 moved back to ap", rebalanced, watch.replaceReasons())
	}
	t.Logf("most active at once: fill %d, heal %d, return %d", watch.mostIn("fill"), watch.mostIn("heal"), watch.mostIn("return"))
}

// TestRegionSelectionThroughTheGateway is issue 28's per-request
// geography on real processes: agents labelled region=eu and region=us,
// each egressing from its own loopback address, a pool spread over both;
// 30 requests as <pool>.region-eu are all carried by eu proxies (by
// X-Proxyfleet-Proxy against the views' labels, and by the address the
// site saw), a session keeps its selection, <pool>.region-mars is a 503
// naming the label, and a username off the grammar is a 407.
func TestRegionSelectionThroughTheGateway(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]int{} // source address → requests the site saw
	site := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		mu.Lock()
		seen[host]++
		mu.Unlock()
		io.WriteString(w, "page for "+host)
	}))
	t.Cleanup(site.Close)
	eu := &labelledAgent{target: "t-eu", labels: "region=eu", source: "127.0.0.2"}
	us := &labelledAgent{target: "t-us", labels: "region=us", source: "127.0.0.3"}
	f := startLabelledFleet(t, []*labelledAgent{eu, us}, site)
	gw := f.startGateway()
	f.apply(events.PoolSpec{Name: "geo", Provider: "local", Size: 4,
		Placement: &events.Placement{Spread: []events.Spread{{Label: "region", Weights: map[string]int{"eu": 1, "us": 1}}}}})
	var vs []placedView
	waitFor(t, 90*time.Second, "2 ready proxies on eu and 2 on us", func() bool {
		vs = f.placed("geo")
		got, ready := spreadOf(vs, "region")
		return ready && got["eu"] == 2 && got["us"] == 2
	})
	region := map[string]string{}
	for _, v := range vs {
		region[v.ID] = v.Labels["region"]
	}

	c := gatewayClient(t, gw, "geo.region-eu")
	// The gateway reads the views on its own: wait until it routes.
	waitFor(t, 30*time.Second, "the gateway to route geo.region-eu", func() bool {
		code, _, _, err := viaGateway(c, site.URL+"/")
		return err == nil && code == 200
	})
	mu.Lock()
	clear(seen)
	mu.Unlock()
	carried := map[string]int{}
	for i := range 30 {
		code, body, via, err := viaGateway(c, site.URL+"/")
		if err != nil || code != 200 {
			t.Fatalf("request %d as geo.region-eu: %d %q %v", i, code, body, err)
		}
		if region[via] != "eu" {
			t.Errorf("request %d as geo.region-eu was carried by %q (region %q); want an eu proxy", i, via, region[via])
		}
		carried[via]++
	}
	if len(carried) != 2 {
		t.Errorf("30 requests as geo.region-eu were carried by %v; want both eu proxies", carried)
	}
	mu.Lock()
	if seen[eu.source] != 30 || len(seen) != 1 {
		t.Errorf("the site saw the 30 requests from %v; want all from eu's %s", seen, eu.source)
	}
	mu.Unlock()

	// A session keeps its selection: one us proxy for all its requests.
	sc := gatewayClient(t, gw, "geo.region-us.session-s1")
	sessionVia := map[string]int{}
	for i := range 5 {
		code, body, via, err := viaGateway(sc, site.URL+"/")
		if err != nil || code != 200 {
			t.Fatalf("request %d as geo.region-us.session-s1: %d %q %v", i, code, body, err)
		}
		sessionVia[via]++
	}
	for via := range sessionVia {
		if len(sessionVia) != 1 || region[via] != "us" {
			t.Errorf("session s1 of region us was carried by %v; want one us proxy", sessionVia)
		}
	}

	// No ready proxy carries region=mars: a 503 that names the label.
	code, body, _, err := viaGateway(gatewayClient(t, gw, "geo.region-mars"), site.URL+"/")
	if err != nil || code != 503 || !strings.Contains(body, "region=mars") || !strings.Contains(body, `"geo"`) {
		t.Errorf("as geo.region-mars: %d %q %v; want 503 naming the pool and region=mars", code, body, err)
	}
	// Usernames off <pool>[.<label>-<value>]...[.session-<id>]: 407.
	for user, want := range map[string]string{
		"geo.region":                 `"region" is neither <label>-<value> nor session-<id>`,
		"geo.Region-eu":              `the label name "Region"`,
		"geo.region-eu.region-us":    "label region is selected twice",
		"geo.session-s1.region-eu":   "the session comes last",
		"geo.region-e!u":             "the value of label region",
		"geo.region-eu.session-a.b-": "the session comes last",
	} {
		code, body, _, err := viaGateway(gatewayClient(t, gw, user), site.URL+"/")
		if err != nil || code != 407 || !strings.Contains(body, want) || !strings.Contains(body, "<pool>[.<label>-<value>]...[.session-<id>]") {
			t.Errorf("as %s: %d %q %v; want 407 saying %q and quoting the grammar", user, code, body, err, want)
		}
	}
}

// TestPlacementBadInput sends placements and fallbacks the planner must
// refuse, as new pools and as changes of an applied one, through the real
// API: each is refused naming its field path, and nothing is written
// (no intent event; the new pool absent, the applied one at its
// revision).
func TestPlacementBadInput(t *testing.T) {
	f := newFleet(t, "--labels", "region=eu,country=de")
	f.dumpLogsOnFailure()
	f.startAll()
	good := f.apply(events.PoolSpec{Name: "good", Provider: "local", Size: 1,
		Placement: &events.Placement{Require: map[string][]string{"country": {"de"}}, Spread: []events.Spread{{Label: "region", Weights: map[string]int{"eu": 1}}}}})
	f.waitPool("good", 1, "ready", 60*time.Second)

	cases := []struct {
		name, placement, gateway, field, says string
	}{
		{"a required label no live target carries", `{"require":{"provider":["hetzner"]}}`, "", "placement.require.provider", "no live target of entry local carries this label"},
		{"a spread over a label no live target carries", `{"spread":[{"label":"rack","weights":{"r1":1}}]}`, "", "placement.spread[0].label", "no live target of entry local carries this label"},
		{"a malformed required label", `{"require":{"Region":["eu"]}}`, "", "placement.require", "label key"},
		{"a malformed required value", `{"require":{"region":["EU"]}}`, "", "placement.require.region[0]", "label value"},
		{"a required key without values", `{"require":{"region":[]}}`, "", "placement.require.region", "at least one value"},
		{"a zero weight", `{"spread":[{"label":"region","weights":{"eu":0}}]}`, "", "placement.spread[0].weights.eu", "from 1 to 1000000"},
		{"a negative weight", `{"spread":[{"label":"region","weights":{"eu":-5}}]}`, "", "placement.spread[0].weights.eu", "from 1 to 1000000"},
		{"a weight over 1,000,000", `{"spread":[{"label":"region","weights":{"eu":1000001}}]}`, "", "placement.spread[0].weights.eu", "from 1 to 1000000"},
		{"a fractional weight", `{"spread":[{"label":"region","weights":{"eu":0.5}}]}`, "", "placement.spread[0].weights.eu", ""},
		{"a spread without weights", `{"spread":[{"label":"region","weights":{}}]}`, "", "placement.spread[0].weights", "at least one"},
		{"a label spread over twice", `{"spread":[{"label":"region","weights":{"eu":1}},{"label":"region","weights":{"us":1}}]}`, "", "placement.spread[1].label", "earlier spread"},
		{"a weight for a value require excludes", `{"require":{"region":["eu"]},"spread":[{"label":"region","weights":{"eu":1,"us":1}}]}`, "", "placement.spread[0].weights.us", "placement.require.region excludes"},
		{"a fallback to the pool itself", "", `{"fallback":["%s"]}`, "gateway.fallback[0]", "names this pool itself"},
		{"a fallback named twice", "", `{"fallback":["x1","x1"]}`, "gateway.fallback[1]", "named twice"},
		{"a malformed fallback", "", `{"fallback":["No Pool"]}`, "gateway.fallback[0]", ""},
		{"a tierMemory under 1s", "", `{"fallback":["x1"],"tierMemory":"10ms"}`, "gateway.tierMemory", ""},
	}
	intents := f.intentEvents()
	for _, c := range cases {
		for _, pool := range []string{"fresh", "good"} {
			body := `{"name":"` + pool + `","provider":"local","size":1`
			if c.placement != "" {
				body += `,"placement":` + c.placement
			}
			if c.gateway != "" {
				body += `,"gateway":` + strings.ReplaceAll(c.gateway, "%s", pool)
			}
			body += "}"
			r := f.req("fleet.api.pool.apply", body, nil)
			var reply struct {
				Error struct {
					Message string `json:"message"`
					Fields  []struct {
						Field  string `json:"field"`
						Reason string `json:"reason"`
					} `json:"fields"`
				} `json:"error"`
			}
			if r.Code != "400" && r.Code != "422" || json.Unmarshal(r.Data, &reply) != nil {
				t.Errorf("%s (pool %s): %s %s; want a 400 or 422 naming %s", c.name, pool, r.Code, r.Data, c.field)
				continue
			}
			named := strings.Contains(reply.Error.Message, c.field) && strings.Contains(reply.Error.Message, c.says)
			for _, fe := range reply.Error.Fields {
				named = named || fe.Field == c.field && strings.Contains(fe.Reason, c.says)
			}
			if !named {
				t.Errorf("%s (pool %s): %s; want field %s saying %q", c.name, pool, r.Data, c.field, c.says)
			}
		}
	}
	if after := f.intentEvents(); after != intents {
		t.Errorf("the refused applies appended %d intent events; want none", after-intents)
	}
	if r := f.req("fleet.api.pool.get", `{"name":"fresh"}`, nil); r.Code != "404" && r.Code != "422" {
		t.Errorf("pool.get fresh after refused applies: %s %s; want it unknown", r.Code, r.Data)
	}
	now := must(t, "pool.get good", func(ctx context.Context) (api.PoolView, error) { return f.api.PoolGet(ctx, "good") })
	if now.Revision != good.Revision || fmt.Sprint(now.Spec.Placement) != fmt.Sprint(good.Spec.Placement) || now.Spec.Gateway != nil {
		t.Errorf("pool good after refused changes: revision %d, placement %v, gateway %v; want revision %d with its placement %v unchanged",
			now.Revision, now.Spec.Placement, now.Spec.Gateway, good.Revision, good.Spec.Placement)
	}
}
