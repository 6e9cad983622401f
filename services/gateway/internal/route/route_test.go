package route

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

func TestParseUser(t *testing.T) {
	long := strings.Repeat("a", MaxSessionID+1)
	cases := []struct {
		user    string
		want    Target
		wantErr string
	}{
		{"demo", Target{Pool: "demo"}, ""},
		{"demo.session-abc", Target{Pool: "demo", Session: "abc"}, ""},
		{"demo.session-A_b-9", Target{Pool: "demo", Session: "A_b-9"}, ""},
		{"demo.session-a.session-b", Target{}, "the session comes last"},
		{"demo.country-de", Target{Pool: "demo", Labels: []Label{{"country", "de"}}}, ""},
		{"demo.region-eu.session-s1", Target{Pool: "demo", Labels: []Label{{"region", "eu"}}, Session: "s1"}, ""},
		{"demo.region-eu.country-de.session-s1", Target{Pool: "demo", Labels: []Label{{"country", "de"}, {"region", "eu"}}, Session: "s1"}, ""},
		{"demo.country-de.region-eu-west-1", Target{Pool: "demo", Labels: []Label{{"country", "de"}, {"region", "eu-west-1"}}}, ""},
		{"demo.session-s1.region-eu", Target{}, "the session comes last"},
		{"demo.region-eu.region-us", Target{}, "label region is selected twice"},
		{"demo.region-", Target{}, "the value of label region must be"},
		{"demo.Region-eu", Target{}, `the label name "Region" must be`},
		{"demo.-eu", Target{}, `"-eu" is neither <label>-<value> nor session-<id>`},
		{"demo.", Target{}, `"" is neither`},
		{"demo.a-1.b-1.c-1.d-1.e-1.f-1.g-1.h-1.i-1", Target{}, "at most 8 labels"},
		{"demo.session-", Target{}, "a session id is"},
		{"demo.session-" + long, Target{}, "a session id is"},
		{"demo.other", Target{}, `"other" is neither <label>-<value> nor session-<id> (username is ` + UserGrammar + ")"},
		{"Demo", Target{}, "the pool name must be"},
		{"", Target{}, "the pool name is required"},
		{".session-abc", Target{}, "the pool name is required"},
	}
	for _, c := range cases {
		got, err := ParseUser(c.user)
		if c.wantErr == "" {
			if err != nil || !reflect.DeepEqual(got, c.want) {
				t.Errorf("%q: got %+v, %v; want %+v", c.user, got, err, c.want)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), c.wantErr) {
			t.Errorf("%q: got %+v, %v; want an error with %q", c.user, got, err, c.wantErr)
		}
	}
}

func fill(tb *Table, pool string, n int) {
	for i := range n {
		tb.Set(Proxy{ID: fmt.Sprintf("%s-%d", pool, i), Pool: pool, Address: fmt.Sprintf("127.0.0.1:%d", 20000+i)})
	}
}

// TestRoundRobin: consecutive connections visit every ready proxy in
// turn, and a proxy that leaves ready is skipped at once.
func TestRoundRobin(t *testing.T) {
	tb := NewTable(Limits{}, nil)
	fill(tb, "demo", 3)
	fill(tb, "other", 2)
	seen := map[string]int{}
	for range 30 {
		x, err := tb.Pick(Target{Pool: "demo"})
		if err != nil {
			t.Fatal(err)
		}
		if x.Pool != "demo" {
			t.Fatalf("picked %+v for pool demo", x)
		}
		seen[x.ID]++
	}
	if len(seen) != 3 || seen["demo-0"] != 10 || seen["demo-1"] != 10 || seen["demo-2"] != 10 {
		t.Fatalf("30 picks over 3 proxies: %v", seen)
	}
	tb.Remove("demo-1")
	for range 10 {
		x, _ := tb.Pick(Target{Pool: "demo"})
		if x.ID == "demo-1" {
			t.Fatal("picked a proxy that left ready")
		}
	}
	if _, err := tb.Pick(Target{Pool: "none"}); !errors.Is(err, ErrNoProxy) {
		t.Fatalf("unknown pool: %v", err)
	}
}

// TestExclude: a failover attempt never gets a proxy already tried, and
// runs out with ErrNoProxy.
func TestExclude(t *testing.T) {
	tb := NewTable(Limits{}, nil)
	fill(tb, "demo", 3)
	var tried []string
	for range 3 {
		x, err := tb.Pick(Target{Pool: "demo"}, tried...)
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range tried {
			if id == x.ID {
				t.Fatalf("picked %s again after %v", x.ID, tried)
			}
		}
		tried = append(tried, x.ID)
	}
	if _, err := tb.Pick(Target{Pool: "demo"}, tried...); !errors.Is(err, ErrNoProxy) {
		t.Fatalf("all tried: %v", err)
	}
}

// TestLeastConnections: the proxy with the fewest open connections is
// picked; Done gives a connection back.
func TestLeastConnections(t *testing.T) {
	tb := NewTable(Limits{}, nil)
	tb.SetSpec("demo", &events.GatewaySpec{Strategy: events.StrategyLeastConnections})
	fill(tb, "demo", 3)
	var held []Proxy
	for range 6 {
		x, err := tb.Pick(Target{Pool: "demo"})
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, x)
	}
	open := tb.Open("demo")
	if open["demo-0"] != 2 || open["demo-1"] != 2 || open["demo-2"] != 2 {
		t.Fatalf("6 connections over 3 proxies: %v", open)
	}
	// Closing both of demo-1's connections makes it the least loaded.
	for _, x := range held {
		if x.ID == "demo-1" {
			tb.Done(x)
		}
	}
	for range 2 {
		if x, _ := tb.Pick(Target{Pool: "demo"}); x.ID != "demo-1" {
			t.Fatalf("picked %s; want demo-1, the least loaded (%v)", x.ID, tb.Open("demo"))
		}
	}
}

// TestRandom: random picks only ready proxies and reaches each of them.
func TestRandom(t *testing.T) {
	tb := NewTable(Limits{}, nil)
	tb.SetSpec("demo", &events.GatewaySpec{Strategy: events.StrategyRandom})
	fill(tb, "demo", 3)
	seen := map[string]bool{}
	for range 300 {
		x, err := tb.Pick(Target{Pool: "demo"})
		if err != nil {
			t.Fatal(err)
		}
		seen[x.ID] = true
	}
	if len(seen) != 3 {
		t.Fatalf("300 random picks reached %v", seen)
	}
}

// TestSessions: a session keeps its proxy while it is used within the
// TTL, moves when its proxy leaves ready or is excluded, and expires.
func TestSessions(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	tb := NewTable(Limits{}, func() time.Time { return now })
	tb.SetSpec("demo", &events.GatewaySpec{SessionTTL: events.Duration(time.Minute)})
	fill(tb, "demo", 3)
	s := Target{Pool: "demo", Session: "abc"}
	first, err := tb.Pick(s)
	if err != nil {
		t.Fatal(err)
	}
	for range 10 {
		now = now.Add(50 * time.Second) // each use renews the TTL
		if x, _ := tb.Pick(s); x.ID != first.ID {
			t.Fatalf("session moved from %s to %s while used", first.ID, x.ID)
		}
	}
	// Another session and plain connections do not disturb it.
	other, _ := tb.Pick(Target{Pool: "demo", Session: "xyz"})
	if x, _ := tb.Pick(s); x.ID != first.ID {
		t.Fatalf("session moved to %s after another session took %s", x.ID, other.ID)
	}
	// Its proxy failed: the failover attempt excludes it and re-pins.
	moved, err := tb.Pick(s, first.ID)
	if err != nil || moved.ID == first.ID {
		t.Fatalf("failover of the session: %+v, %v", moved, err)
	}
	if x, _ := tb.Pick(s); x.ID != moved.ID {
		t.Fatalf("after failover the session went to %s; want %s", x.ID, moved.ID)
	}
	// Its proxy left ready: the next connection re-pins.
	tb.Remove(moved.ID)
	again, _ := tb.Pick(s)
	if again.ID == moved.ID {
		t.Fatalf("session kept %s after it left ready", moved.ID)
	}
	if x, _ := tb.Pick(s); x.ID != again.ID {
		t.Fatalf("re-pinned session moved again to %s", x.ID)
	}
	wantSessions(t, tb, "demo", 2, "live")
	now = now.Add(61 * time.Second)
	wantSessions(t, tb, "demo", 0, "after their TTL")
}

// wantSessions fails t unless pool has want live sessions at the moment
// when names.
func wantSessions(t *testing.T, tb *Table, pool string, want int, when string) {
	t.Helper()
	if n := tb.Sessions(pool); n != want {
		t.Fatalf("%s: %d live sessions of %s, want %d", when, n, pool, want)
	}
}

// TestSessionsDefaultTTL: without a gateway spec a session lives 10
// minutes after its last use.
func TestSessionsDefaultTTL(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	tb := NewTable(Limits{}, func() time.Time { return now })
	fill(tb, "demo", 2)
	tb.Pick(Target{Pool: "demo", Session: "s"})
	now = now.Add(9 * time.Minute)
	wantSessions(t, tb, "demo", 1, "after 9 min")
	now = now.Add(2 * time.Minute)
	wantSessions(t, tb, "demo", 0, "after 11 min")
}

// TestProxyMovesPool: a proxy id seen in another pool leaves the first.
func TestProxyMovesPool(t *testing.T) {
	tb := NewTable(Limits{}, nil)
	tb.Set(Proxy{ID: "x", Pool: "a", Address: "127.0.0.1:1"})
	tb.Set(Proxy{ID: "x", Pool: "b", Address: "127.0.0.1:1"})
	if len(tb.Ready("a")) != 0 || len(tb.Ready("b")) != 1 {
		t.Fatalf("a %v, b %v", tb.Ready("a"), tb.Ready("b"))
	}
}

func TestCoolingProxiesAreAvoidedUntilNoneIsLeft(t *testing.T) {
	now := time.Unix(1000, 0)
	tb := NewTable(Limits{}, func() time.Time { return now })
	for _, id := range []string{"a", "b", "c"} {
		tb.Set(Proxy{ID: id, Pool: "p", Address: id + ":1"})
	}
	if !tb.Cool("b", 10*time.Second) {
		t.Fatal("Cool of a proxy not cooling: false")
	}
	if tb.Cool("b", 10*time.Second) {
		t.Error("Cool of a proxy already cooling: true; want false (reported once)")
	}
	for i := range 6 {
		x, err := tb.Pick(Target{Pool: "p"})
		if err != nil || x.ID == "b" {
			t.Fatalf("pick %d while b cools: %v %v", i, x.ID, err)
		}
		tb.Done(x)
	}
	// A session pinned to a proxy that starts cooling moves.
	tb.Cool("c", 10*time.Second)
	x, _ := tb.Pick(Target{Pool: "p", Session: "s"})
	if x.ID != "a" {
		t.Fatalf("session's first pick with b and c cooling: %s; want a", x.ID)
	}
	tb.Cool("a", 10*time.Second)
	// Everything cools: they are used all the same, the session stays.
	if x, err := tb.Pick(Target{Pool: "p", Session: "s"}); err != nil || x.ID != "a" {
		t.Errorf("session pick with every proxy cooling: %v %v; want a", x.ID, err)
	}
	if _, err := tb.Pick(Target{Pool: "p"}); err != nil {
		t.Errorf("pick with every proxy cooling: %v; want one of them", err)
	}
	// The period ends: b is picked again.
	now = now.Add(11 * time.Second)
	seen := map[string]bool{}
	for range 3 {
		x, _ := tb.Pick(Target{Pool: "p"})
		seen[x.ID] = true
	}
	if !seen["b"] || !tb.Cool("b", time.Second) {
		t.Errorf("after the cooldown: picks %v, want b among them and a new cooling period reported", seen)
	}
}

// TestSessionsAreBoundedPerPoolAndPerClient: one new session id per
// request cannot grow the table past its bounds; the session forgotten is
// the least recently used of the client (or of the pool), and a session
// in use keeps its proxy.
func TestSessionsAreBoundedPerPoolAndPerClient(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	tb := NewTable(Limits{SessionsPerPool: 5, SessionsPerClient: 3}, func() time.Time { return now })
	fill(tb, "demo", 3)
	pick := func(client, session string) Proxy {
		t.Helper()
		now = now.Add(time.Second)
		x, err := tb.Pick(Target{Pool: "demo", Session: session, Client: client})
		if err != nil {
			t.Fatal(err)
		}
		tb.Done(x)
		return x
	}
	a1 := pick("10.0.0.1", "a1")
	pick("10.0.0.1", "a2")
	pick("10.0.0.1", "a3")
	if x := pick("10.0.0.1", "a1"); x.ID != a1.ID { // a1 is now the most recent of 10.0.0.1
		t.Fatalf("a1 moved from %s to %s", a1.ID, x.ID)
	}
	pick("10.0.0.1", "a4") // past 3 for 10.0.0.1: a2 goes
	wantSessions(t, tb, "demo", 3, "10.0.0.1 at its bound")
	if x := pick("10.0.0.1", "a1"); x.ID != a1.ID {
		t.Fatalf("a1, used lately, was forgotten: moved from %s to %s", a1.ID, x.ID)
	}
	// Another client's sessions count apart, up to the pool's bound.
	b1 := pick("10.0.0.2", "b1")
	pick("10.0.0.2", "b2")
	wantSessions(t, tb, "demo", 5, "the pool at its bound")
	for i := range 100 {
		pick("10.0.0.3", fmt.Sprintf("c%d", i))
	}
	wantSessions(t, tb, "demo", 5, "after 100 new sessions of a third client")
	// The third client holds at most 3; the pool's least recently used
	// went first: b1 and b2 are the most recent of the others.
	if x := pick("10.0.0.2", "b1"); x.ID != b1.ID {
		t.Errorf("b1 moved from %s to %s", b1.ID, x.ID)
	}
	wantSessions(t, tb, "demo", 5, "at the end")
}

// TestSessionsExpireInUseOrder: sessions expire after their TTL, also
// when the pool's TTL changes between their uses.
func TestSessionsExpireInUseOrder(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	tb := NewTable(Limits{}, func() time.Time { return now })
	tb.SetSpec("demo", &events.GatewaySpec{SessionTTL: events.Duration(time.Minute)})
	fill(tb, "demo", 2)
	for i := range 10 {
		tb.Pick(Target{Pool: "demo", Session: fmt.Sprintf("s%d", i), Client: "c"})
		now = now.Add(10 * time.Second)
	}
	now = now.Add(5 * time.Second)
	// s0 was used 105s ago, s9 15s ago: s0..s4 are past a minute.
	wantSessions(t, tb, "demo", 5, "after 100s with a 1m TTL")
	tb.SetSpec("demo", &events.GatewaySpec{SessionTTL: events.Duration(25 * time.Second)})
	wantSessions(t, tb, "demo", 2, "with the TTL cut to 25s (s8 used 25s ago, s9 15s ago)")
	now = now.Add(time.Minute)
	wantSessions(t, tb, "demo", 0, "a minute later")
}

// BenchmarkPickNewSession is one new session id per pick into a full
// table: it costs the same whatever the table holds.
func BenchmarkPickNewSession(b *testing.B) {
	for _, n := range []int{1_000, 100_000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			tb := NewTable(Limits{SessionsPerPool: n}, nil)
			fill(tb, "demo", 3)
			for i := range n {
				tb.Pick(Target{Pool: "demo", Session: fmt.Sprint("w", i), Client: fmt.Sprint(i % 100)})
			}
			b.ResetTimer()
			for i := range b.N {
				x, _ := tb.Pick(Target{Pool: "demo", Session: fmt.Sprint("s", i), Client: "c"})
				tb.Done(x)
			}
		})
	}
}
