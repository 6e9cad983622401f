package ban

import (
	"fmt"
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
		if _, v, ok := d.Observe("a", "example.com", rules, 429, nil, nil); ok {
			t.Fatalf("spread matches reported %+v", v)
		}
		now = now.Add(6 * time.Second)
	}
	// Responses that do not match are not counted.
	for range 5 {
		if _, _, ok := d.Observe("b", "example.com", rules, 200, nil, nil); ok {
			t.Fatal("a 200 counted")
		}
	}
	d.Observe("b", "example.com", rules, 429, nil, nil)
	d.Observe("c", "example.com", rules, 429, nil, nil)
	d.Observe("b", "example.com", rules, 429, nil, nil)
	_, v, ok := d.Observe("b", "example.com", rules, 429, nil, nil)
	if !ok || v != (Verdict{Proxy: "b", Rule: "too-many", Action: events.BanActionRetire, Matches: 3}) {
		t.Fatalf("third match of b: %+v, %v", v, ok)
	}
	if _, _, ok := d.Observe("b", "example.com", rules, 429, nil, nil); ok {
		t.Fatal("b reported twice")
	}
	if _, _, ok := d.Observe("c", "example.com", rules, 429, nil, nil); ok {
		t.Fatal("c reported after 2 matches")
	}
	// Forgotten (it left the fleet), the id counts from zero again.
	d.Forget("b")
	if _, _, ok := d.Observe("b", "example.com", rules, 429, nil, nil); ok {
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
		if _, _, ok := d.Observe("a", "example.com", rules, 403, nil, nil); ok {
			t.Fatalf("reported after %d matches", i+1)
		}
		now = now.Add(14 * time.Second)
	}
	if _, v, ok := d.Observe("a", "example.com", rules, 403, nil, nil); !ok || v.Rule != "forbidden" {
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

// TestActions: every rule names its match; a retry rule gives no
// verdict; a cooldown rule cools a proxy for one site at a time (its
// threshold counts per site, 1 by default) and keeps giving verdicts; a
// retire rule reports once, after which matches are still named.
func TestActions(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	d := NewDetector(func() time.Time { return now })
	rules := compile(t,
		events.BanRule{Name: "busy", Status: []int{503}, Action: events.BanActionRetry},
		events.BanRule{Name: "blocked", Status: []int{403}, Action: events.BanActionCooldown, Cooldown: events.Duration(time.Hour)},
		events.BanRule{Name: "captcha", Body: "captcha", Action: events.BanActionCooldown, Threshold: 2},
		events.BanRule{Name: "gone", Status: []int{451}, Threshold: 2},
	)
	type obs struct {
		proxy, site string
		status      int
		body        string
		match       string
		verdict     *Verdict
	}
	for i, c := range []obs{
		{"a", "s1.com", 200, "ok", "", nil},
		{"a", "s1.com", 503, "", "busy", nil},
		{"a", "s1.com", 503, "", "busy", nil},
		{"a", "s1.com", 403, "", "blocked", &Verdict{Proxy: "a", Rule: "blocked", Action: events.BanActionCooldown, Site: "s1.com", Cooldown: time.Hour, Matches: 1}},
		{"a", "s2.com", 403, "", "blocked", &Verdict{Proxy: "a", Rule: "blocked", Action: events.BanActionCooldown, Site: "s2.com", Cooldown: time.Hour, Matches: 1}},
		{"a", "s1.com", 200, "captcha", "captcha", nil},
		{"a", "s2.com", 200, "captcha", "captcha", nil},
		{"a", "s1.com", 200, "captcha", "captcha", &Verdict{Proxy: "a", Rule: "captcha", Action: events.BanActionCooldown, Site: "s1.com", Cooldown: 30 * time.Minute, Matches: 2}},
		{"a", "s1.com", 451, "", "gone", nil},
		{"a", "s9.com", 451, "", "gone", &Verdict{Proxy: "a", Rule: "gone", Action: events.BanActionRetire, Matches: 2}},
		// Reported: its ban pages are still named, no verdict follows.
		{"a", "s3.com", 403, "", "blocked", nil},
		{"a", "s3.com", 451, "", "gone", nil},
		// A 403 with a captcha matches two rules: the first names it.
		{"b", "s1.com", 403, "captcha", "blocked", &Verdict{Proxy: "b", Rule: "blocked", Action: events.BanActionCooldown, Site: "s1.com", Cooldown: time.Hour, Matches: 1}},
	} {
		match, v, ok := d.Observe(c.proxy, c.site, rules, c.status, nil, []byte(c.body))
		if match != c.match || ok != (c.verdict != nil) || (ok && v != *c.verdict) {
			t.Errorf("observation %d (%s on %s: %d %q): match %q verdict %+v %v; want %q %+v", i, c.proxy, c.site, c.status, c.body, match, v, ok, c.match, c.verdict)
		}
	}
	if !d.Report("b") || d.Report("b") || d.Report("a") {
		t.Error("Report: want true for b once, then false; false for the reported a")
	}
}

// TestSweep: matches of sites never seen again leave the detector once
// out of their window.
func TestSweep(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	d := NewDetector(func() time.Time { return now })
	rules := compile(t, events.BanRule{Name: "captcha", Body: "captcha", Action: events.BanActionCooldown, Threshold: 3, Window: events.Duration(time.Minute)})
	for i := range 100 {
		d.Observe("a", fmt.Sprintf("s%d.com", i), rules, 200, nil, []byte("captcha"))
	}
	if n := len(d.hits); n != 100 {
		t.Fatalf("%d sites counted; want 100", n)
	}
	now = now.Add(2 * time.Minute)
	d.Observe("a", "other.com", rules, 200, nil, []byte("fine"))
	if n := len(d.hits); n != 0 {
		t.Errorf("%d counts kept past their window; want 0", n)
	}
}
