package ban

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

func compile(t *testing.T, rules ...events.BanRule) []Rule {
	t.Helper()
	c, err := Compile(rules)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestMatches: a response matches a rule only when it meets every
// condition the rule sets.
func TestMatches(t *testing.T) {
	captcha := []byte("<html><title>Are you a robot?</title><div class=captcha>")
	cases := []struct {
		rule   events.BanRule
		status int
		header http.Header
		body   []byte
		want   bool
	}{
		{events.BanRule{Name: "r", Status: []int{429, 403}}, 429, nil, nil, true},
		{events.BanRule{Name: "r", Status: []int{429, 403}}, 200, nil, nil, false},
		{events.BanRule{Name: "r", Body: "(?i)captcha"}, 200, nil, captcha, true},
		{events.BanRule{Name: "r", Body: "(?i)captcha"}, 200, nil, []byte("hello"), false},
		{events.BanRule{Name: "r", Status: []int{200}, Body: "(?i)captcha"}, 503, nil, captcha, false},
		{events.BanRule{Name: "r", Header: "server", HeaderMatch: "^cloudflare"}, 403, http.Header{"Server": {"cloudflare"}}, nil, true},
		{events.BanRule{Name: "r", Header: "Server", HeaderMatch: "^cloudflare"}, 403, http.Header{"Server": {"nginx"}}, nil, false},
		{events.BanRule{Name: "r", Header: "Server", HeaderMatch: "^cloudflare"}, 403, nil, nil, false},
	}
	for i, c := range cases {
		r := compile(t, c.rule)[0]
		if got := r.Matches(c.status, c.header, c.body); got != c.want {
			t.Errorf("case %d (%+v on %d): got %v, want %v", i, c.rule, c.status, got, c.want)
		}
	}
}

// TestBodyLimit: a body pattern sees only the first 64 KiB.
func TestBodyLimit(t *testing.T) {
	r := compile(t, events.BanRule{Name: "r", Body: "captcha"})[0]
	body := []byte(strings.Repeat("x", events.BanBodyLimit) + "captcha")
	if r.Matches(200, nil, body) {
		t.Fatal("matched a pattern past the first 64 KiB")
	}
	if !r.Matches(200, nil, body[events.BanBodyLimit-100:]) {
		t.Fatal("did not match within the limit")
	}
	if !NeedsBody([]Rule{r}) || NeedsBody(compile(t, events.BanRule{Name: "s", Status: []int{429}})) {
		t.Fatal("NeedsBody")
	}
}

// TestThresholdInWindow: a proxy is reported after threshold matches
// within the window, once, naming the rule; matches spread wider than
// the window never add up; other proxies count apart.
func TestThresholdInWindow(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	d := NewDetector(func() time.Time { return now })
	rules := compile(t, events.BanRule{Name: "too-many", Status: []int{429}, Threshold: 3, Window: events.Duration(10 * time.Second)})
	// Spread: one match every 6 s never has 3 within 10 s.
	for range 10 {
		if v, ok := d.Observe("a", rules, 429, nil, nil); ok {
			t.Fatalf("spread matches reported %+v", v)
		}
		now = now.Add(6 * time.Second)
	}
	// Responses that do not match are not counted.
	for range 5 {
		if _, ok := d.Observe("b", rules, 200, nil, nil); ok {
			t.Fatal("a 200 counted")
		}
	}
	d.Observe("b", rules, 429, nil, nil)
	d.Observe("c", rules, 429, nil, nil)
	d.Observe("b", rules, 429, nil, nil)
	v, ok := d.Observe("b", rules, 429, nil, nil)
	if !ok || v != (Verdict{Proxy: "b", Rule: "too-many", Matches: 3}) {
		t.Fatalf("third match of b: %+v, %v", v, ok)
	}
	if _, ok := d.Observe("b", rules, 429, nil, nil); ok {
		t.Fatal("b reported twice")
	}
	if _, ok := d.Observe("c", rules, 429, nil, nil); ok {
		t.Fatal("c reported after 2 matches")
	}
	// Forgotten (it left the fleet), the id counts from zero again.
	d.Forget("b")
	if _, ok := d.Observe("b", rules, 429, nil, nil); ok {
		t.Fatal("b reported at its first match after Forget")
	}
}

// TestDefaults: a rule without threshold and window reports after 5
// matches within a minute.
func TestDefaults(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	d := NewDetector(func() time.Time { return now })
	rules := compile(t, events.BanRule{Name: "forbidden", Status: []int{403}})
	for i := range 4 {
		if _, ok := d.Observe("a", rules, 403, nil, nil); ok {
			t.Fatalf("reported after %d matches", i+1)
		}
		now = now.Add(14 * time.Second)
	}
	if v, ok := d.Observe("a", rules, 403, nil, nil); !ok || v.Rule != "forbidden" {
		t.Fatalf("fifth match within 56 s: %+v, %v", v, ok)
	}
}

// TestCompileRefusesEmptyRule: a rule without conditions would ban every
// proxy; Compile refuses it even if validation was skipped.
func TestCompileRefusesEmptyRule(t *testing.T) {
	if _, err := Compile([]events.BanRule{{Name: "all"}}); err == nil || !strings.Contains(err.Error(), "sets no status, header or body") {
		t.Fatalf("got %v", err)
	}
	if _, err := Compile([]events.BanRule{{Name: "bad", Body: "("}}); err == nil {
		t.Fatal("a bad body pattern compiled")
	}
}
