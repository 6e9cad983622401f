package crawlload

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// gateway is a loopback stand-in for a gateway: a forward proxy that
// answers every request itself, "ok" while up and 502 while down, and
// records the pool (proxy user) it was asked for.
type gateway struct {
	srv  *httptest.Server
	down atomic.Bool
	user atomic.Value
}

func newGateway(t *testing.T) *gateway {
	g := &gateway{}
	g.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !r.URL.IsAbs() {
			http.Error(w, "not a proxy request", http.StatusBadRequest)
			return
		}
		if auth := r.Header.Get("Proxy-Authorization"); auth != "" {
			g.user.Store(auth)
		}
		if g.down.Load() {
			http.Error(w, "no proxy", http.StatusBadGateway)
			return
		}
		w.Write([]byte("ok"))
	}))
	t.Cleanup(g.srv.Close)
	return g
}

func loadThrough(gws []*gateway, o Options) *Load {
	return New("http://origin.invalid/page", len(gws), func(i int) *url.URL {
		return &url.URL{Scheme: "http", Host: gws[i].srv.Listener.Addr().String(), User: url.UserPassword("pool", "pw")}
	}, o)
}

func TestOutcomes(t *testing.T) {
	gws := []*gateway{newGateway(t), newGateway(t), newGateway(t)}
	l := loadThrough(gws, Options{NewConnEachRequest: true})

	if r := l.try(0); r.Outcome != OK || r.Err != "" {
		t.Fatalf("every gateway up: %+v, want ok", r)
	}
	if gws[0].user.Load() == nil {
		t.Fatal("the gateway was not sent the pool as proxy user")
	}
	gws[1].down.Store(true)
	if r := l.try(1); r.Outcome != Retried || r.Gateway != 1 {
		t.Fatalf("gateway 2 down: %+v, want retried through gateway 3", r)
	}
	if r := l.try(0); r.Outcome != OK {
		t.Fatalf("gateway 1 up: %+v, want ok", r)
	}
	gws[2].down.Store(true)
	r := l.try(1)
	if r.Outcome != Failed {
		t.Fatalf("gateways 2 and 3 down: %+v, want failed", r)
	}
	if !strings.Contains(r.Err, "gateway 2: status 502") || !strings.Contains(r.Err, "retry on gateway 3: status 502") {
		t.Fatalf("a failed request's error names both tries: %q", r.Err)
	}
	// The last gateway retries through the first.
	if r := l.try(2); r.Outcome != Retried {
		t.Fatalf("gateway 3 down, gateway 1 up: %+v, want retried", r)
	}
}

func TestBetweenAndFirstOK(t *testing.T) {
	l := &Load{}
	t0 := time.Now()
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	for _, r := range []Request{
		{Sent: at(0), Gateway: 0, Outcome: OK},
		{Sent: at(1), Gateway: 1, Outcome: Failed, Err: "e1"},
		{Sent: at(2), Gateway: 1, Outcome: Retried},
		{Sent: at(3), Gateway: 1, Outcome: Failed, Err: "e3"},
		{Sent: at(4), Gateway: 1, Outcome: OK},
		{Sent: at(5), Gateway: 0, Outcome: OK},
	} {
		l.record(r)
	}
	counts, errs := l.Between(at(1), at(4), 1)
	if counts[OK] != 0 || counts[Retried] != 1 || counts[Failed] != 2 {
		t.Fatalf("counts in [1s, 4s): %v", counts)
	}
	if len(errs) != 1 || errs[0] != "e1" {
		t.Fatalf("errors capped at 1: %q", errs)
	}
	if counts, _ := l.Between(at(2), time.Time{}, 0); counts[OK] != 2 || counts[Retried] != 1 || counts[Failed] != 1 {
		t.Fatalf("counts from 2s on: %v", counts)
	}
	if got := l.FirstOK(1, at(0)); !got.Equal(at(4)) {
		t.Fatalf("gateway 2's first ok: %v, want 4s", got.Sub(t0))
	}
	if got := l.FirstOK(0, at(1)); !got.Equal(at(5)) {
		t.Fatalf("gateway 1's first ok from 1s: %v, want 5s", got.Sub(t0))
	}
	if got := l.FirstOK(0, at(6)); !got.IsZero() {
		t.Fatalf("no ok after 6s, got %v", got)
	}
	if l.Count() != 6 {
		t.Fatalf("count %d, want 6", l.Count())
	}
}

// TestRunFollowsAMovedGateway: the workers take turns over the gateways,
// and a gateway replaced at a new address is reached there.
func TestRunFollowsAMovedGateway(t *testing.T) {
	gws := []*gateway{newGateway(t), newGateway(t)}
	var moved atomic.Pointer[gateway]
	l := New("http://origin.invalid/page", 2, func(i int) *url.URL {
		g := gws[i]
		if m := moved.Load(); i == 1 && m != nil {
			g = m
		}
		return &url.URL{Scheme: "http", Host: g.srv.Listener.Addr().String(), User: url.UserPassword("pool", "pw")}
	}, Options{})
	l.Run(2, time.Millisecond)
	waitCount(t, l, 20)
	gws[1].srv.Close()
	moved.Store(newGateway(t))
	since := time.Now()
	deadline := time.Now().Add(30 * time.Second)
	for l.FirstOK(1, since).IsZero() {
		if time.Now().After(deadline) {
			l.End()
			t.Fatal("no request went through the moved gateway within 30 s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	l.End()
	n := l.Count()
	time.Sleep(20 * time.Millisecond)
	if l.Count() != n {
		t.Fatalf("requests recorded after End: %d, then %d", n, l.Count())
	}
	counts, errs := l.Between(time.Time{}, time.Time{}, 3)
	if counts[OK] == 0 || counts[Failed] != 0 {
		t.Fatalf("counts %v, errors %q: want every request through (one gateway stayed up)", counts, errs)
	}
	if l.FirstOK(0, time.Time{}).IsZero() {
		t.Fatal("no request went through gateway 1")
	}
}

func waitCount(t *testing.T, l *Load, n int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for l.Count() < n {
		if time.Now().After(deadline) {
			l.End()
			t.Fatalf("only %d requests within 30 s, want %d", l.Count(), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
