package planner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nats.go/micro"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/page"
	"proxyfleet/services/planner/internal/apiserver"
)

// seedBatch bounds the appends in flight while seeding.
const seedBatch = 1000

// seed is a batch of events appended to FLEET_EVENTS as their writers would
// (source, subject, Msg-Id), published asynchronously so that a test can
// build a fleet of thousands of proxies in a second.
type seed struct {
	h    *harness
	at   time.Time
	msgs []*nats.Msg
}

func (h *harness) seed() *seed { return &seed{h: h, at: time.Now().UTC()} }

func (s *seed) add(source, aggregate, id, kind, msgID string, data any) {
	s.h.t.Helper()
	env, err := events.NewEnvelope(msgID, source, events.EnvelopeType(aggregate, kind), id, s.at, data)
	if err != nil {
		s.h.t.Fatal(err)
	}
	body, err := env.MarshalJSON()
	if err != nil {
		s.h.t.Fatal(err)
	}
	m := nats.NewMsg(events.SubjectOf(source, aggregate, id, kind))
	m.Data = body
	m.Header.Set(jetstream.MsgIDHeader, msgID)
	s.msgs = append(s.msgs, m)
}

// pool adds the applied event of a pool of size proxies of entry local.
func (s *seed) pool(name string, size int) {
	d := events.PoolAppliedData{Revision: 1, Spec: events.PoolSpec{Name: name, Provider: "local", Size: size,
		Port: events.DefaultProxyPort, UnhealthyAfter: events.Duration(events.DefaultUnhealthyAfter)}}
	s.add(events.SourcePlanner, events.AggregatePool, name, events.PoolApplied, name+".applied.1", d)
}

// proxy adds the requested event of proxy id of pool, on local/t1.
func (s *seed) proxy(pool, id string) {
	d := events.ProxyRequestedData{
		ProxySpec: events.ProxySpec{Pool: pool, Entry: "local", Target: "t1", Instance: events.InstanceName(id), Revision: 1, Port: events.DefaultProxyPort},
	}
	s.add(events.SourcePlanner, events.AggregateProxy, id, events.ProxyRequested, events.ProxyEventID(id, events.ProxyRequested, 1), d)
}

// append publishes the batch and waits until the stream stored all of it.
func (s *seed) append() {
	s.h.t.Helper()
	for len(s.msgs) > 0 {
		n := min(len(s.msgs), seedBatch)
		acks := make([]jetstream.PubAckFuture, 0, n)
		for _, m := range s.msgs[:n] {
			f, err := s.h.c.JS.PublishMsgAsync(m)
			if err != nil {
				s.h.t.Fatalf("publish %s: %v", m.Subject, err)
			}
			acks = append(acks, f)
		}
		for _, f := range acks {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				s.h.t.Fatalf("publish %s: %v", f.Msg().Subject, err)
			case <-time.After(waitTimeout):
				s.h.t.Fatalf("publish %s: no ack", f.Msg().Subject)
			}
		}
		s.msgs = s.msgs[n:]
	}
}

// proxyIDs returns n proxy ids of pool in id order, every other one of
// "<pool>-000000", "<pool>-000001", …, so that a test can add proxies
// between them.
func proxyIDs(pool string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%06d", pool, 2*i)
	}
	return out
}

// listedPage is one proxy.list or pool.list answer with its raw size.
type listedPage struct {
	ids  []string
	next string
	size int
}

// listPage sends one list request that must succeed.
func (h *harness) listPage(subject, body string) listedPage {
	h.t.Helper()
	r := h.request(subject, body, nil)
	if r.Code != "" {
		h.t.Fatalf("%s %s: got error %s %+v, want a page", subject, body, r.Code, r.Error)
	}
	var raw struct {
		Proxies []events.ProxyView `json:"proxies"`
		Pools   []api.PoolView     `json:"pools"`
		Next    *string            `json:"next"`
	}
	if err := json.Unmarshal(r.Body, &raw); err != nil {
		h.t.Fatalf("%s reply: %v", subject, err)
	}
	if raw.Next == nil {
		h.t.Fatalf("%s reply has no next: %.200s", subject, r.Body)
	}
	pg := listedPage{next: *raw.Next, size: len(r.Body)}
	for _, x := range raw.Proxies {
		pg.ids = append(pg.ids, x.ID)
	}
	for _, p := range raw.Pools {
		pg.ids = append(pg.ids, p.Name)
	}
	if len(pg.ids) > 0 && pg.next != "" && pg.next != pg.ids[len(pg.ids)-1] {
		h.t.Fatalf("%s %s: next %q is not the page's last key %q", subject, body, pg.next, pg.ids[len(pg.ids)-1])
	}
	return pg
}

// walk lists every page from the start: body is the request without its
// paging fields ("" or `"pool":"a"`); between(n, pg) runs after page n.
// It checks that keys rise strictly across the walk and returns them.
func (h *harness) walk(subject, body string, limit int, between func(int, listedPage)) ([]string, []listedPage) {
	h.t.Helper()
	var all []string
	var pages []listedPage
	after := ""
	for n := 0; ; n++ {
		fields := []string{}
		if body != "" {
			fields = append(fields, body)
		}
		if limit > 0 {
			fields = append(fields, fmt.Sprintf(`"limit":%d`, limit))
		}
		if after != "" {
			fields = append(fields, fmt.Sprintf(`"after":%q`, after))
		}
		pg := h.listPage(subject, "{"+strings.Join(fields, ",")+"}")
		for _, id := range pg.ids {
			if len(all) > 0 && id <= all[len(all)-1] {
				h.t.Fatalf("page %d: key %q after %q: the walk is not in strictly rising order", n, id, all[len(all)-1])
			}
			all = append(all, id)
		}
		pages = append(pages, pg)
		if pg.next == "" {
			return all, pages
		}
		if len(pg.ids) == 0 {
			h.t.Fatalf("page %d: empty with next %q", n, pg.next)
		}
		if n > 100_000 {
			h.t.Fatal("the walk does not end")
		}
		if between != nil {
			between(n, pg)
		}
		after = pg.next
	}
}

// TestProxyListWalksEveryProxyOnce: walking proxy.list page by page
// returns every live proxy exactly once, in id order, whatever the limit,
// while proxies come and go between pages: a proxy deleted before its page
// is left out without shifting the others, one deleted after its page was
// listed once, one added after the cursor shows up, one added before it does
// not. Every page but the last holds exactly limit proxies; the last has an
// empty next.
func TestProxyListWalksEveryProxyOnce(t *testing.T) {
	h := newHarness(t)
	a, b := proxyIDs("a", 1200), proxyIDs("b", 300)
	s := h.seed()
	// Room for the proxies the test adds: the leader retires no excess.
	s.pool("a", 1210)
	s.pool("b", 300)
	for _, id := range a {
		s.proxy("a", id)
	}
	for _, id := range b {
		s.proxy("b", id)
	}
	s.append()
	r := h.leader()
	h.folded(r)

	// Default and largest limits.
	if pg := h.listPage(proxyList, ``); len(pg.ids) != page.DefaultLimit || pg.next != a[page.DefaultLimit-1] {
		t.Errorf("empty body: got %d proxies, next %q; want %d, next %q", len(pg.ids), pg.next, page.DefaultLimit, a[page.DefaultLimit-1])
	}
	if pg := h.listPage(proxyList, `{"pool":"b"}`); len(pg.ids) != 300 || pg.next != "" || !slices.Equal(pg.ids, b) {
		t.Errorf("pool b, default limit: got %d proxies, next %q; want all 300 in order, next \"\"", len(pg.ids), pg.next)
	}
	if pg := h.listPage(proxyList, `{"limit":1000}`); len(pg.ids) != 1000 || pg.next != a[999] {
		t.Errorf("limit 1000: got %d proxies, next %q; want 1000, next %q", len(pg.ids), pg.next, a[999])
	}
	if pg := h.listPage(proxyList, `{"pool":"a","after":"`+a[1199]+`"}`); len(pg.ids) != 0 || pg.next != "" {
		t.Errorf("after the last proxy: got %v, next %q; want an empty last page", pg.ids, pg.next)
	}
	// A cursor that names no proxy still works: the page starts after it.
	if pg := h.listPage(proxyList, `{"pool":"a","limit":2,"after":"a-000011"}`); !slices.Equal(pg.ids, a[6:8]) {
		t.Errorf("after a-000011: got %v, want %v", pg.ids, a[6:8])
	}

	for _, limit := range []int{1, 7, 100, 1000} {
		got, pages := h.walk(proxyList, `"pool":"b"`, limit, nil)
		if !slices.Equal(got, b) {
			t.Errorf("limit %d: walked %d proxies, want the 300 of pool b in order", limit, len(got))
		}
		for i, pg := range pages[:len(pages)-1] {
			if len(pg.ids) != limit {
				t.Errorf("limit %d: page %d holds %d proxies, want %d", limit, i, len(pg.ids), limit)
			}
		}
	}

	// Changes between the first and the second page of a walk of pool a.
	const limit = 100
	goneLater, goneSeen := a[250], a[5] // on page 3; on page 1
	addedAhead, addedBehind := "a-000301", "a-000051"
	got, pages := h.walk(proxyList, `"pool":"a"`, limit, func(n int, pg listedPage) {
		if n != 0 {
			return
		}
		h.observe(goneLater, events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
		h.observe(goneSeen, events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
		s := h.seed()
		s.proxy("a", addedAhead)
		s.proxy("a", addedBehind)
		s.append()
		h.folded(r)
	})
	var want []string
	for _, id := range append(slices.Clone(a), addedAhead) {
		if id != goneLater {
			want = append(want, id)
		}
	}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("walk with changes: got %d proxies, want %d (every proxy once, %s deleted ahead left out, %s listed before its deletion, %s added ahead in, %s added behind out)",
			len(got), len(want), goneLater, goneSeen, addedAhead, addedBehind)
		for _, id := range []string{goneLater, goneSeen, addedAhead, addedBehind} {
			t.Logf("%s listed: %v", id, slices.Contains(got, id))
		}
	}
	for i, pg := range pages[:len(pages)-1] {
		if len(pg.ids) != limit {
			t.Errorf("walk with changes: page %d holds %d proxies, want %d", i, len(pg.ids), limit)
		}
	}

	// Every live proxy of every pool, in one order.
	all, _ := h.walk(proxyList, "", 333, nil)
	wantAll := append(slices.Clone(b), addedAhead, addedBehind)
	for _, id := range a {
		if id != goneLater && id != goneSeen {
			wantAll = append(wantAll, id)
		}
	}
	slices.Sort(wantAll)
	if !slices.Equal(all, wantAll) {
		t.Errorf("walk of every pool: got %d proxies, want %d", len(all), len(wantAll))
	}
}

// TestPoolListWalksEveryPoolOnce: pool.list pages the same way, by name.
func TestPoolListWalksEveryPoolOnce(t *testing.T) {
	h := newHarness(t)
	s := h.seed()
	var names []string
	for i := range 25 {
		names = append(names, fmt.Sprintf("pool-%02d", i))
		s.pool(names[i], 0)
	}
	s.append()
	r := h.leader()
	h.folded(r)
	if pg := h.listPage(poolList, ``); !slices.Equal(pg.ids, names) || pg.next != "" {
		t.Errorf("empty body: got %v next %q, want every pool and no next", pg.ids, pg.next)
	}
	got, pages := h.walk(poolList, "", 10, func(n int, _ listedPage) {
		if n == 0 {
			h.ok(poolDelete, `{"name":"pool-15"}`, nil) // no proxies: it leaves the list at once
		}
	})
	want := slices.DeleteFunc(slices.Clone(names), func(n string) bool { return n == "pool-15" })
	if !slices.Equal(got, want) {
		t.Errorf("walk: got %v, want %v", got, want)
	}
	if len(pages) != 3 || len(pages[0].ids) != 10 || len(pages[1].ids) != 10 {
		t.Errorf("walk: got %d pages, want 10, 10 and the rest", len(pages))
	}
}

// TestListRepliesFitMaxPayload: with 10,000 proxies, all of them in one
// reply would take over four times the server's max payload; the first
// 2,000 are unhealthy with a long probe error (a view of 1.5 kB), so that
// 1,000 of them do not fit in one message either. Walked at the largest
// limit, proxy.list cuts those pages short of the max payload, setting
// next, and the walk still returns every proxy once, in order.
func TestListRepliesFitMaxPayload(t *testing.T) {
	h := newHarness(t)
	const n, sick = 10_000, 2_000
	ids := proxyIDs("big", n)
	reason := strings.Repeat("connect: connection refused; ", 40) // 1,160 bytes
	s := h.seed()
	s.pool("big", n)
	for i, id := range ids {
		s.proxy("big", id)
		if i < sick {
			s.add(events.SourceHealth, events.AggregateProxy, id, events.ProxyUnhealthy,
				events.ProxyEventID(id, events.ProxyUnhealthy, 1), events.ProxyUnhealthyData{Reason: reason, Streak: 3})
		}
	}
	s.append()
	r := h.leader()
	h.folded(r)

	maxPayload := int(h.c.NC.MaxPayload())
	budget := r.api.ReplyBudget()
	if budget >= maxPayload {
		t.Fatalf("reply budget %d, want below the max payload %d", budget, maxPayload)
	}
	for _, body := range []string{`"pool":"big"`, ""} {
		got, pages := h.walk(proxyList, body, page.MaxLimit, nil)
		if !slices.Equal(got, ids) {
			t.Errorf("{%s}: walked %d proxies, want the %d in order", body, len(got), n)
		}
		total, cut := 0, 0
		for i, pg := range pages {
			total += pg.size
			if pg.size > budget {
				t.Errorf("{%s} page %d: %d bytes, over the budget %d (max payload %d)", body, i, pg.size, budget, maxPayload)
			}
			if pg.next != "" && len(pg.ids) < page.MaxLimit {
				cut++
			}
		}
		if cut == 0 {
			t.Errorf("{%s}: no page was cut short of the limit by size: %d pages", body, len(pages))
		}
		if total < 4*maxPayload {
			t.Errorf("{%s}: the walk took %d bytes in all, want over four times the max payload %d", body, total, maxPayload)
		}
		t.Logf("{%s}: %d proxies in %d pages, %d bytes in all, max payload %d", body, len(got), len(pages), total, maxPayload)
	}
}

// TestBadPagingIsRefusedAndChangesNothing: limits out of range, cursors
// that are no key and mistyped paging fields are refused with the path of
// the field, 400 or 422 as every request, and append nothing.
func TestBadPagingIsRefusedAndChangesNothing(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":1}`, nil)
	h.requested(1)
	h.waitFor("the create command", func() bool { return len(h.commandsOf(events.VerbCreate)) == 1 })

	cases := []struct {
		name    string
		subject string
		body    string
		code    string
		message string // exact
	}{
		{"limit 0", proxyList, `{"limit":0}`, "422", `limit: must be between 1 and 1000 (got "0")`},
		{"limit negative", proxyList, `{"pool":"demo","limit":-5}`, "422", `limit: must be between 1 and 1000 (got "-5")`},
		{"limit over the max", proxyList, `{"limit":1001}`, "422", `limit: must be between 1 and 1000 (got "1001")`},
		{"limit a string", proxyList, `{"limit":"10"}`, "400", `limit: must be an integer, got string`},
		{"limit a fraction", proxyList, `{"limit":1.5}`, "400", `limit: must be an integer, got number 1.5`},
		{"limit out of range", proxyList, `{"limit":99999999999999999999}`, "400", `limit: is out of range, got number 99999999999999999999`},
		{"limit twice", proxyList, `{"limit":1,"limit":2}`, "400", `limit: duplicate key`},
		{"limit upper-case", proxyList, `{"Limit":5}`, "400", `Limit: unknown field; keys are case-sensitive: did you mean "limit"?`},
		{"after a number", proxyList, `{"after":7}`, "400", `after: must be a string, got number`},
		{"after no id", proxyList, `{"after":"Demo 1"}`, "422",
			`after: must be the "next" of a previous page, a proxy id (` + events.IdentifierRule + `) (got "Demo 1")`},
		{"every field at once", proxyList, `{"pool":"Demo","limit":0,"after":"-x"}`, "422",
			`pool: must be ` + events.IdentifierRule + ` (got "Demo"); limit: must be between 1 and 1000 (got "0"); after: must be the "next" of a previous page, a proxy id (` + events.IdentifierRule + `) (got "-x")`},
		{"bad limit, unknown pool", proxyList, `{"pool":"nope","limit":0}`, "422", `limit: must be between 1 and 1000 (got "0")`},
		{"pool.list limit 0", poolList, `{"limit":0}`, "422", `limit: must be between 1 and 1000 (got "0")`},
		{"pool.list after no name", poolList, `{"after":"DEMO"}`, "422",
			`after: must be the "next" of a previous page, a pool name (` + events.IdentifierRule + `) (got "DEMO")`},
		{"pool.list unknown key", poolList, `{"pool":"demo"}`, "400", `pool: unknown field`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h.changesNothing(t, func() { h.refused(t, tc.subject, tc.body, tc.code, tc.message) })
		})
	}
}

// TestPoolSizeUpTo100000: a pool of 100,000 proxies is accepted and one of
// 100,001 refused, changing nothing. The big pool fills what its target can
// hold and says why it stops there.
func TestPoolSizeUpTo100000(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1", Capacity: 2})
	r := h.leader()
	var pv api.PoolView
	h.ok(poolApply, `{"name":"huge","provider":"local","size":100000}`, &pv)
	if pv.Spec.Size != 100_000 || pv.Revision != 1 {
		t.Fatalf("apply 100000: got size %d revision %d, want 100000 at revision 1", pv.Spec.Size, pv.Revision)
	}
	h.requested(2)
	h.waitFor("placed condition", func() bool {
		c, ok := events.FindCondition(r.poolView("huge").Conditions, events.ConditionPlaced)
		return ok && c.Status == events.ConditionFalse && c.Reason == events.ReasonCapacityExhausted
	})

	before := h.lastEventSeq()
	rep := h.request(poolApply, `{"name":"huge","provider":"local","size":100001}`, nil)
	if rep.Code != "422" || rep.Error.Message != `size: must be at most 100000 (got "100001")` {
		t.Fatalf("apply 100001: got %s %+v, want 422 size: must be at most 100000", rep.Code, rep.Error)
	}
	if got := h.lastEventSeq(); got != before {
		t.Errorf("refused apply appended: last seq %d, want %d", got, before)
	}
	h.ok(poolGet, `{"name":"huge"}`, &pv)
	if pv.Spec.Size != 100_000 || pv.Revision != 1 {
		t.Errorf("after the refused apply: size %d revision %d, want 100000 at revision 1", pv.Spec.Size, pv.Revision)
	}
	h.requested(2)
}

// TestPoolGetCountsLiveProxies: pool.get and pool.list count the proxies
// of the pool that are live, by the lifecycle (events.Transition): every
// state but the terminal deleted and abandoned, which absorb every later
// event. Failed and retiring proxies are live (their instance may still
// run, and the planner still acts on them) but not active: active counts
// requested, provisioning, running, ready and unhealthy. The counts agree
// with proxy.list, which lists the same live proxies.
func TestPoolGetCountsLiveProxies(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":4}`, nil)
	ids, _ := h.requested(4)
	h.observe(ids[0], events.ProxyProvisioning, 1, events.ProxyProvisioningData{Entry: "local", Target: "t1", Instance: events.InstanceName(ids[0]), Attempt: 1})
	h.observe(ids[1], events.ProxyRunning, 1, events.ProxyRunningData{Address: "127.0.0.1:1", Attempt: 1})
	h.observe(ids[2], events.ProxyReady, 1, events.ProxyReadyData{Address: "127.0.0.1:1"})
	// ids[3] is gone before it ever ran; ids[1] fails and is retired, then
	// gone; ids[2] is deleted by the operator without cleanup (abandoned).
	h.observe(ids[3], events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
	h.observe(ids[1], events.ProxyFailed, 1, events.ProxyFailedData{Class: events.ClassPermanent, Reason: "boom", Attempt: 1})
	h.waitFor("the failed proxy retired", func() bool { return r.poolView("demo").States[events.ProxyRetiring] == 1 })
	check := func(what string, want map[string]int, active int) {
		t.Helper()
		var pv api.PoolView
		h.ok(poolGet, `{"name":"demo"}`, &pv)
		var pl api.PoolList
		h.ok(poolList, `{}`, &pl)
		list := h.listPage(proxyList, `{"pool":"demo"}`)
		sum := 0
		for _, n := range pv.States {
			sum += n
		}
		if !maps.Equal(pv.States, want) || pv.Active != active || len(pl.Pools) != 1 || !maps.Equal(pl.Pools[0].States, want) || sum != len(list.ids) {
			t.Errorf("%s: pool.get states %v active %d, pool.list %+v, proxy.list %d proxies; want states %v active %d, as many listed",
				what, pv.States, pv.Active, pl.Pools, len(list.ids), want, active)
		}
	}
	h.ok(proxyDelete, `{"id":"`+ids[2]+`","skipCleanup":true}`, nil)
	h.requested(7) // replacements of ids[1], ids[2] and ids[3]
	h.folded(r)
	check("with a retiring proxy", map[string]int{events.ProxyProvisioning: 1, events.ProxyRetiring: 1, events.ProxyRequested: 3}, 4)

	h.observe(ids[1], events.ProxyDeleted, 1, events.ProxyDeletedData{Attempt: 1})
	h.folded(r)
	check("settled", map[string]int{events.ProxyProvisioning: 1, events.ProxyRequested: 3}, 4)
	for _, id := range []string{ids[1], ids[2], ids[3]} {
		var x Proxy
		h.ok(proxyGet, `{"id":"`+id+`"}`, &x)
		if !events.IsTerminal(x.State) {
			t.Errorf("proxy %s: state %s, want deleted or abandoned", id, x.State)
		}
	}
}

// benchState is a planner state of one pool of n requested proxies.
func benchState(b *testing.B, n int) *state {
	b.Helper()
	st := newState(testLogger(), defaultKeepFinished)
	at := time.Now()
	seq := uint64(0)
	apply := func(agg, id, kind, msgID string, data any) {
		env, err := events.NewEnvelope(msgID, events.SourcePlanner, events.EnvelopeType(agg, kind), id, at, data)
		if err != nil {
			b.Fatal(err)
		}
		seq++
		st.apply(bus.Event{Envelope: env, Seq: seq, Aggregate: agg, ID: id, Kind: kind})
	}
	apply(events.AggregatePool, "big", events.PoolApplied, "big.applied.1", events.PoolAppliedData{Revision: 1,
		Spec: events.PoolSpec{Name: "big", Provider: "local", Size: n, Port: events.DefaultProxyPort}})
	for range n {
		id := events.NewProxyID("big")
		apply(events.AggregateProxy, id, events.ProxyRequested, events.ProxyEventID(id, events.ProxyRequested, 1),
			events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "big", Entry: "local", Target: "t1", Instance: events.InstanceName(id), Revision: 1, Port: events.DefaultProxyPort}})
	}
	if got := len(st.pools["big"].members); got != n {
		b.Fatalf("state holds %d proxies, want %d", got, n)
	}
	return st
}

// BenchmarkProxyListPage measures what proxy.list does under the planner's
// lock for one page of 500 in the middle of a 100,000-proxy pool: the
// heap selection it uses (first-after) against copying and sorting every
// live proxy, then slicing the page (baseline: what proxy.list did before
// it was paged, plus the slicing).
func BenchmarkProxyListPage(b *testing.B) {
	const n, limit = 100_000, page.DefaultLimit
	st := benchState(b, n)
	members := st.pools["big"].members
	ids := slices.Sorted(maps.Keys(members))
	after := ids[n/2]
	want := ids[n/2+1 : n/2+1+limit+1]
	check := func(b *testing.B, views []events.ProxyView) {
		if len(views) != len(want) || views[0].ID != want[0] || views[len(views)-1].ID != want[len(want)-1] {
			b.Fatalf("got %d views from %s, want %d from %s", len(views), views[0].ID, len(want), want[0])
		}
	}
	b.Run("baseline", func(b *testing.B) {
		for b.Loop() {
			all := make([]events.ProxyView, 0, len(members))
			for _, x := range members {
				all = append(all, x.ProxyView)
			}
			slices.SortFunc(all, func(x, y events.ProxyView) int { return strings.Compare(x.ID, y.ID) })
			i, _ := slices.BinarySearchFunc(all, after, func(v events.ProxyView, k string) int { return strings.Compare(v.ID, k) })
			check(b, all[i+1:i+1+limit+1])
		}
	})
	b.Run("first-after", func(b *testing.B) {
		for b.Loop() {
			pg := page.FirstAfter(maps.Values(members), func(x *Proxy) string { return x.ID }, after, limit+1)
			views := make([]events.ProxyView, len(pg))
			for i, x := range pg {
				views[i] = x.ProxyView
			}
			check(b, views)
		}
	})
}

var instanceDelete = events.APISubject("instance", "delete")

// refused sends body to subject, which must refuse it with code and
// exactly message, whose first field starts the message.
func (h *harness) refused(t *testing.T, subject, body, code, message string) {
	t.Helper()
	r := h.request(subject, body, nil)
	if r.Code != code {
		t.Fatalf("code: got %q (%+v), want %q", r.Code, r.Error, code)
	}
	if r.Error.Message != message {
		t.Errorf("message:\n got %q\nwant %q", r.Error.Message, message)
	}
	if len(r.Error.Fields) == 0 || !strings.HasPrefix(r.Error.Message, r.Error.Fields[0].Field+": "+r.Error.Fields[0].Reason) {
		t.Errorf("fields %+v: the first does not start the message %q", r.Error.Fields, r.Error.Message)
	}
}

// secretsSeq is the last sequence of the stream behind fleet-secrets: any
// write or delete of a secret moves it.
func (h *harness) secretsSeq() uint64 {
	h.t.Helper()
	return h.lastSeq("KV_" + bus.BucketSecrets)
}

// TestStrictInputIsRefusedAndChangesNothing: requests that encoding/json
// would have accepted (a missing or null size, a key in the wrong case, a
// duplicate key, at any depth) are refused with a message that starts with
// the path of the offending field, on every endpoint, and append no event,
// send no command and write no secret. The pool they aim at keeps its
// size.
func TestStrictInputIsRefusedAndChangesNothing(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.leader()
	const demo = `"name":"demo","provider":"local","auth":{"username":"u","password":"p"}`
	h.ok(poolApply, `{`+demo+`,"size":2}`, nil)
	h.requested(2)
	// The creates are published after the decisions, asynchronously: wait
	// for them, so that every case below starts from a settled stream.
	h.waitFor("the pool's 2 create commands", func() bool { return len(h.commandsOf(events.VerbCreate)) == 2 })

	cases := []struct {
		name    string
		subject string
		body    string
		code    string
		message string // exact
	}{
		{"no size", poolApply, `{` + demo + `}`, "422", `size: is required (send 0 to empty the pool)`},
		{"null size", poolApply, `{` + demo + `,"size":null}`, "422", `size: is required (send 0 to empty the pool)`},
		{"no size and a bad name", poolApply, `{"name":"Demo","provider":"local"}`, "422",
			`size: is required (send 0 to empty the pool); name: must be ` + events.IdentifierRule + ` (got "Demo")`},
		{"upper-case key", poolApply, `{"NAME":"demo","provider":"local","size":2}`, "400",
			`NAME: unknown field; keys are case-sensitive: did you mean "name"?`},
		{"duplicate key", poolApply, `{` + demo + `,"size":2,"size":0}`, "400", `size: duplicate key`},
		{"nested duplicate", poolApply, `{"name":"demo","provider":"local","size":2,"auth":{"username":"u","password":"p","username":"v"}}`, "400",
			`auth.username: duplicate key`},
		{"nested wrong type", poolApply, `{"name":"demo","provider":"local","size":2,"auth":{"username":7,"password":"p"}}`, "400",
			`auth.username: must be a string, got number`},
		{"unknown nested key", poolApply, `{"name":"demo","provider":"local","size":2,"auth":{"username":"u","password":"p","realm":"x"}}`, "400",
			`auth.realm: unknown field`},
		{"wrong element type", poolApply, `{"name":"demo","provider":"local","size":2,"targets":["t1",{}]}`, "400",
			`targets[1]: must be a string, got object`},
		{"unhealthyAfter too short", poolApply, `{` + demo + `,"size":2,"unhealthyAfter":"5s"}`, "422",
			`unhealthyAfter: must be at least 10s (got "5s")`},
		{"unhealthyAfter negative", poolApply, `{` + demo + `,"size":2,"unhealthyAfter":"-1m"}`, "422",
			`unhealthyAfter: must not be negative (got "-1m0s")`},
		{"unhealthyAfter not a duration", poolApply, `{` + demo + `,"size":2,"unhealthyAfter":"soon"}`, "400",
			`unhealthyAfter: must be a duration string such as "72h": "soon"`},
		{"unhealthyAfter a number", poolApply, `{` + demo + `,"size":2,"unhealthyAfter":30}`, "400",
			`unhealthyAfter: must be a duration string such as "72h"`},
		{"trailing data", poolApply, `{` + demo + `,"size":0} {}`, "400",
			`(body): malformed JSON at byte 84: invalid character '{' after top-level value`},
		{"empty", poolApply, ``, "400", `(body): is empty; send a JSON object`},
		{"egress range with host bits", poolApply, `{` + demo + `,"size":2,"egress":{"allowCIDRs":["10.1.0.0/16","10.2.0.1/16"]}}`, "422",
			`egress.allowCIDRs[1]: has host bits set; write 10.2.0.0/16 (got "10.2.0.1/16")`},
		{"egress range not a range", poolApply, `{` + demo + `,"size":2,"egress":{"allowCIDRs":["intranet"]}}`, "422",
			`egress.allowCIDRs[0]: must be an IP address or a CIDR such as 10.1.0.0/16 (got "intranet")`},
		{"egress port out of range", poolApply, `{` + demo + `,"size":2,"egress":{"allowPorts":[8080,0,70000]}}`, "422",
			`egress.allowPorts[1]: must be between 1 and 65535 (got "0"); egress.allowPorts[2]: must be between 1 and 65535 (got "70000")`},
		{"egress port a string", poolApply, `{` + demo + `,"size":2,"egress":{"allowPorts":["8080"]}}`, "400",
			`egress.allowPorts[0]: must be an integer, got string`},
		{"egress unknown key", poolApply, `{` + demo + `,"size":2,"egress":{"allow":["10.0.0.0/8"]}}`, "400",
			`egress.allow: unknown field`},
		{"unhealthyAfter zero", poolApply, `{` + demo + `,"size":2,"unhealthyAfter":"0s"}`, "422",
			`unhealthyAfter: must be at least 10s (leave it out for the default 2m0s) (got "0s")`},
		{"unhealthyAfter empty", poolApply, `{` + demo + `,"size":2,"unhealthyAfter":""}`, "422",
			`unhealthyAfter: must be at least 10s (leave it out for the default 2m0s) (got "0s")`},
		{"ban rule threshold zero", poolApply, `{` + demo + `,"size":2,"gateway":{"banRules":[{"name":"r","status":[403],"threshold":0}]}}`, "422",
			`gateway.banRules[0].threshold: must be 1 or more (leave it out for the default 5) (got "0")`},
		{"cooldown rule threshold zero", poolApply, `{` + demo + `,"size":2,"gateway":{"banRules":[{"name":"r","status":[403],"action":"cooldown","threshold":0}]}}`, "422",
			`gateway.banRules[0].threshold: must be 1 or more (leave it out for the default 1) (got "0")`},
		{"ban rule cooldown zero", poolApply, `{` + demo + `,"size":2,"gateway":{"banRules":[{"name":"r","status":[403],"action":"cooldown","cooldown":"0s"}]}}`, "422",
			`gateway.banRules[0].cooldown: must be at least 1s (leave it out for the default 30m0s) (got "0s")`},
		{"ban rule unknown action", poolApply, `{` + demo + `,"size":2,"gateway":{"banRules":[{"name":"r","status":[403],"action":"ban"}]}}`, "422",
			`gateway.banRules[0].action: must be retire, cooldown or retry (got "ban")`},
		{"retireAfterSitesWindow zero", poolApply, `{` + demo + `,"size":2,"gateway":{"retireAfterSitesWindow":"0s"}}`, "422",
			`gateway.retireAfterSitesWindow: must be at least 1m0s (leave it out for the default 1h0m0s) (got "0s")`},
		{"ban rule header not a token", poolApply, `{` + demo + `,"size":2,"gateway":{"banRules":[{"name":"r","header":"X-Why(1)","headerMatch":"x"}]}}`, "422",
			"gateway.banRules[0].header: must be a header name (an HTTP token: letters, digits and !#$%&'*+-.^_`|~) (got \"X-Why(1)\")"},
		{"ban rule body of 900 KiB", poolApply, `{` + demo + `,"size":2,"gateway":{"banRules":[{"name":"r","body":"` + strings.Repeat("a", 900<<10) + `"}]}}`, "422",
			`gateway.banRules[0].body: may be at most 1024 bytes long (got "921600 bytes")`},
		{"apply of 200 KB", poolApply, `{` + demo + `,"size":2,"gateway":{"banRules":[{"name":"r","header":"Server","headerMatch":"` + strings.Repeat("(a|b)", 40<<10) + `"}]}}`, "422",
			`gateway.banRules[0].headerMatch: may be at most 1024 bytes long (got "204800 bytes")`},
		{"autoscale without targetConnections", poolApply, `{` + demo + `,"size":2,"autoscale":{"min":1,"max":3}}`, "422",
			`autoscale.targetConnections: is required`},
		{"name not UTF-8", poolApply, "{\"name\":\"demo\xff\",\"provider\":\"local\",\"size\":2}", "400",
			`name: must be valid UTF-8 text (invalid bytes and unpaired surrogates are refused, and so is U+FFFD)`},

		{"pool.get upper-case", poolGet, `{"Name":"demo"}`, "400", `Name: unknown field; keys are case-sensitive: did you mean "name"?`},
		{"pool.get duplicate", poolGet, `{"name":"demo","name":"demo"}`, "400", `name: duplicate key`},
		{"pool.get unknown", poolGet, `{"name":"nope"}`, "422", `name: unknown pool "nope"`},
		{"pool.list unknown key", poolList, `{"all":true}`, "400", `all: unknown field`},
		{"pool.delete upper-case", poolDelete, `{"NAME":"demo"}`, "400", `NAME: unknown field; keys are case-sensitive: did you mean "name"?`},
		{"pool.delete duplicate", poolDelete, `{"name":"demo","name":"other"}`, "400", `name: duplicate key`},
		{"pool.delete unknown", poolDelete, `{"name":"nope"}`, "422", `name: unknown pool "nope"`},
		{"proxy.get unknown", proxyGet, `{"id":"nope-aaaaaaaaaa"}`, "422", `id: unknown proxy "nope-aaaaaaaaaa"`},
		{"proxy.list upper-case", proxyList, `{"POOL":"demo"}`, "400", `POOL: unknown field; keys are case-sensitive: did you mean "pool"?`},
		{"proxy.list unknown pool", proxyList, `{"pool":"nope"}`, "422", `pool: unknown pool "nope"`},
		{"proxy.delete duplicate", proxyDelete, `{"id":"x","skipCleanup":false,"skipCleanup":true}`, "400", `skipCleanup: duplicate key`},
		{"proxy.delete wrong type", proxyDelete, `{"id":"x","skipCleanup":"yes"}`, "400", `skipCleanup: must be true or false, got string`},
		{"proxy.recycle upper-case", proxyRecycle, `{"ID":"x"}`, "400", `ID: unknown field; keys are case-sensitive: did you mean "id"?`},
		{"proxy.report-ban duplicate", proxyReportBan, `{"id":"x","reason":"a","reason":"b"}`, "400", `reason: duplicate key`},
		{"proxy.report-ban reason not UTF-8", proxyReportBan, "{\"id\":\"x\",\"reason\":\"403 \xff\xfe\"}", "400",
			`reason: must be valid UTF-8 text (invalid bytes and unpaired surrogates are refused, and so is U+FFFD)`},
		{"proxy.report-ban reason an unpaired surrogate", proxyReportBan, `{"id":"x","reason":"403 \ud800"}`, "400",
			`reason: must be valid UTF-8 text (invalid bytes and unpaired surrogates are refused, and so is U+FFFD)`},
		{"instance.delete upper-case", instanceDelete, `{"entry":"local","target":"t1","NAME":"px-a"}`, "400",
			`NAME: unknown field; keys are case-sensitive: did you mean "name"?`},
		{"instance.delete without name", instanceDelete, `{"entry":"local","target":"t1"}`, "422", `name: is required`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			secBefore := h.secretsSeq()
			h.changesNothing(t, func() { h.refused(t, tc.subject, tc.body, tc.code, tc.message) })
			if got := h.secretsSeq(); got != secBefore {
				t.Errorf("fleet-secrets last seq: got %d, want %d (unchanged)", got, secBefore)
			}
		})
	}
	var pv api.PoolView
	h.ok(poolGet, `{"name":"demo"}`, &pv)
	if pv.Spec.Size != 2 || pv.Revision != 1 || pv.Deleted {
		t.Errorf("pool after the refused requests: size %d revision %d deleted %v, want size 2 revision 1", pv.Spec.Size, pv.Revision, pv.Deleted)
	}
	// An explicit 0 is a size: it empties the pool.
	h.ok(poolApply, `{`+demo+`,"size":0}`, &pv)
	if pv.Spec.Size != 0 || pv.Revision != 2 {
		t.Errorf("explicit size 0: got size %d revision %d, want 0 at revision 2", pv.Spec.Size, pv.Revision)
	}
	if _, err := h.secret.Get(context.Background(), "demo"); err != nil {
		t.Errorf("secrets of the applied pool: %v", err)
	}
}

// TestApplyNotRecordedLeavesNoSecrets: an apply whose event the log does
// not store (here the stream refuses messages of its size, as it refused a
// spec too big for an event) answers 500 and puts back the secrets the
// pool had, or none for a new pool: a failed apply leaves nothing behind.
func TestApplyNotRecordedLeavesNoSecrets(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.leader()
	h.ok(poolApply, `{"name":"demo","provider":"local","size":0,"auth":{"username":"u","password":"before"}}`, nil)

	ctx := context.Background()
	s, err := h.c.JS.Stream(ctx, bus.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	small := cfg
	small.MaxMsgSize = 64
	if _, err := h.c.JS.UpdateStream(ctx, small); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"demo", "fresh"} {
		r := h.request(poolApply, `{"name":"`+name+`","provider":"local","size":1,"auth":{"username":"u","password":"after"}}`, nil)
		if r.Code != "500" {
			t.Errorf("%s: apply while the log refuses it: got %q %+v, want 500", name, r.Code, r.Error)
		}
	}
	if _, err := h.c.JS.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	e, err := h.secret.Get(ctx, "demo")
	if err != nil {
		t.Fatalf("demo's secrets after a failed apply: %v", err)
	}
	var sec events.PoolSecrets
	if err := json.Unmarshal(e.Value(), &sec); err != nil || sec.Password != "before" || sec.Revision != 1 {
		t.Errorf("demo's secrets after a failed apply: %+v (%v), want the password of revision 1", sec, err)
	}
	if _, err := h.secret.Get(ctx, "fresh"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Errorf("secrets of a new pool whose apply failed: got %v, want none", err)
	}
	var pv api.PoolView
	h.ok(poolGet, `{"name":"demo"}`, &pv)
	if pv.Revision != 1 || pv.Spec.Size != 0 {
		t.Errorf("demo after the failed apply: revision %d size %d, want revision 1 size 0", pv.Revision, pv.Spec.Size)
	}
}

// TestEndpointNamesAreUnique: nats micro info lists every endpoint under a
// name of its own ("pool-get", "proxy-get" …), each on its API subject, so
// their stats can be told apart. The leader's instance serves the deciding
// endpoints, every replica's the others (see writer.go): together they
// serve each endpoint once.
func TestEndpointNamesAreUnique(t *testing.T) {
	h := newHarness(t)
	r := h.startPlanner("ep", nil)
	h.waitFor("leader", r.IsLeader)
	var infos []micro.Info
	h.waitFor("both instances of the service", func() bool {
		infos = serviceInfos(t, h.c.NC)
		return len(infos) == 2
	})
	names := map[string]string{}
	roles := map[string]bool{}
	for _, info := range infos {
		roles[info.Metadata["role"]] = true
		for _, e := range info.Endpoints {
			if prev, dup := names[e.Name]; dup {
				t.Errorf("endpoint name %q is used for %s and %s", e.Name, prev, e.Subject)
			}
			names[e.Name] = e.Subject
		}
	}
	if !roles["replica"] || !roles["leader"] {
		t.Errorf("instance roles: got %v, want replica and leader", roles)
	}
	for _, want := range [][3]string{{"pool", "get"}, {"proxy", "get"}, {"pool", "delete"}, {"proxy", "delete"}, {"instance", "delete"}} {
		name := want[0] + "-" + want[1]
		if got := names[name]; got != events.APISubject(want[0], want[1]) {
			t.Errorf("endpoint %s: subject %q, want %q", name, got, events.APISubject(want[0], want[1]))
		}
	}
}

// serviceInfos gathers the info every instance of the planner's service
// answers within a second.
func serviceInfos(t *testing.T, nc *nats.Conn) []micro.Info {
	t.Helper()
	inbox := nc.NewRespInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.PublishRequest("$SRV.INFO."+apiserver.ServiceName, inbox, nil); err != nil {
		t.Fatal(err)
	}
	var out []micro.Info
	for {
		msg, err := sub.NextMsg(time.Second)
		if err != nil {
			return out
		}
		var info micro.Info
		if err := json.Unmarshal(msg.Data, &info); err != nil {
			t.Fatal(err)
		}
		out = append(out, info)
	}
}
