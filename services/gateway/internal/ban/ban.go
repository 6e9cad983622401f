// Package ban recognises banned proxies by the responses they relay: a
// pool's ban rules (events.BanRule) match a response by status, header or
// body. Every match names its rule, so the gateway can retry the request
// on another proxy; beyond that a rule's action decides: a retire rule
// that matches Threshold responses of one proxy within its Window reports
// that proxy banned, once; a cooldown rule that matches Threshold
// responses of one proxy from one site within its Window cools the proxy
// for that site; a retry rule gives no verdict.
//
// It holds no I/O: the gateway shows it each plain HTTP response
// ([Detector.Observe]), calls the planner's report-ban API with the
// retire verdicts and records the cooldown verdicts.
package ban

import (
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"sync"
	"time"

	"proxyfleet/pkg/events"
)

// Rule is a compiled events.BanRule.
type Rule struct {
	Name        string
	status      []int
	header      string
	headerMatch *regexp.Regexp
	body        *regexp.Regexp
	action      string
	threshold   int
	window      time.Duration
	cooldown    time.Duration
}

// Action is the rule's action (events.BanActionRetire, …Cooldown or
// …Retry).
func (r Rule) Action() string { return r.action }

// Compile checks and compiles a pool's rules (the pool spec validated
// them already; an error here means a spec that skipped validation).
func Compile(rules []events.BanRule) ([]Rule, error) {
	out := make([]Rule, 0, len(rules))
	for _, r := range rules {
		c := Rule{Name: r.Name, status: slices.Clone(r.Status), header: http.CanonicalHeaderKey(r.Header),
			action: r.ActionOrDefault(), threshold: r.ThresholdOrDefault(), window: r.WindowOrDefault(), cooldown: r.CooldownOrDefault()}
		var err error
		if r.HeaderMatch != "" {
			if c.headerMatch, err = regexp.Compile(r.HeaderMatch); err != nil {
				return nil, fmt.Errorf("ban rule %s: headerMatch: %w", r.Name, err)
			}
		}
		if r.Body != "" {
			if c.body, err = regexp.Compile(r.Body); err != nil {
				return nil, fmt.Errorf("ban rule %s: body: %w", r.Name, err)
			}
		}
		if len(c.status) == 0 && c.headerMatch == nil && c.body == nil {
			return nil, fmt.Errorf("ban rule %s: sets no status, header or body", r.Name)
		}
		switch c.action {
		case events.BanActionRetire, events.BanActionCooldown, events.BanActionRetry:
		default:
			return nil, fmt.Errorf("ban rule %s: unknown action %q", r.Name, r.Action)
		}
		out = append(out, c)
	}
	return out, nil
}

// NeedsBody reports whether any rule looks at the body: only then does the
// gateway keep the first events.BanBodyLimit bytes of a response.
func NeedsBody(rules []Rule) bool {
	return slices.ContainsFunc(rules, func(r Rule) bool { return r.body != nil })
}

// Matches reports whether one response meets every condition of r. body
// is at most the first events.BanBodyLimit bytes (nil when not kept).
func (r Rule) Matches(status int, header http.Header, body []byte) bool {
	if len(r.status) > 0 && !slices.Contains(r.status, status) {
		return false
	}
	if r.headerMatch != nil && !slices.ContainsFunc(header.Values(r.header), r.headerMatch.MatchString) {
		return false
	}
	if r.body != nil {
		if len(body) > events.BanBodyLimit {
			body = body[:events.BanBodyLimit]
		}
		if !r.body.Match(body) {
			return false
		}
	}
	return true
}

// Verdict is a proxy a rule found banned.
type Verdict struct {
	Proxy string
	Rule  string
	// Action is the rule's: events.BanActionRetire (report the proxy
	// banned) or events.BanActionCooldown (keep it off Site for
	// Cooldown).
	Action string
	// Site is the site that banned the proxy (cooldown verdicts only).
	Site     string
	Cooldown time.Duration
	// Matches is how many responses matched within the window.
	Matches int
}

// sweepEvery is how often the detector drops the matches that fell out
// of their rule's window everywhere, not only where a proxy matches again.
const sweepEvery = time.Minute

// Detector counts rule matches per proxy (and per site, for cooldown
// rules). It is safe for concurrent use.
type Detector struct {
	now func() time.Time

	mu sync.Mutex
	// hits holds, per proxy, rule and (for cooldown rules) site, the
	// times of the matches within the rule's window.
	hits map[key]*hits
	// reported holds the proxies already reported: one retire verdict
	// per proxy, as the planner retires it at the first.
	reported map[string]bool
	swept    time.Time
}

type key struct{ proxy, rule, site string }

type hits struct {
	times  []time.Time
	window time.Duration
}

// NewDetector returns a detector; now is the clock (time.Now when nil).
func NewDetector(now func() time.Time) *Detector {
	if now == nil {
		now = time.Now
	}
	return &Detector{now: now, hits: map[key]*hits{}, reported: map[string]bool{}}
}

// Observe counts one response of proxy to a request for site (its
// site.Key) against rules. match is the first rule the response matched,
// "" for none: a matched response is a ban page, which the gateway
// retries on another proxy while it may. ok reports a verdict: the first
// rule with an action (retire, cooldown) that reached its threshold with
// this response. A proxy gets one retire verdict (and none after it);
// [Detector.Forget] clears it when it leaves the fleet.
func (d *Detector) Observe(proxy, site string, rules []Rule, status int, header http.Header, body []byte) (match string, v Verdict, ok bool) {
	now := d.now()
	d.mu.Lock()
	defer d.mu.Unlock()
	if now.Sub(d.swept) >= sweepEvery {
		d.sweepLocked(now)
	}
	for _, r := range rules {
		if !r.Matches(status, header, body) {
			continue
		}
		if match == "" {
			match = r.Name
		}
		if ok || d.reported[proxy] || r.action == events.BanActionRetry {
			continue
		}
		k := key{proxy, r.Name, ""}
		if r.action == events.BanActionCooldown {
			k.site = site
		}
		h := d.hits[k]
		if h == nil {
			h = &hits{window: r.window}
			d.hits[k] = h
		}
		h.drop(now)
		h.times = append(h.times, now)
		if len(h.times) < r.threshold {
			continue
		}
		v, ok = Verdict{Proxy: proxy, Rule: r.Name, Action: r.action, Matches: len(h.times)}, true
		delete(d.hits, k)
		if r.action == events.BanActionCooldown {
			v.Site, v.Cooldown = site, r.cooldown
			continue
		}
		d.reported[proxy] = true
		d.forgetLocked(proxy)
	}
	return match, v, ok
}

// drop forgets the matches out of the window at now.
func (h *hits) drop(now time.Time) {
	cut := 0
	for cut < len(h.times) && now.Sub(h.times[cut]) >= h.window {
		cut++
	}
	h.times = h.times[cut:]
}

func (d *Detector) sweepLocked(now time.Time) {
	d.swept = now
	for k, h := range d.hits {
		if h.drop(now); len(h.times) == 0 {
			delete(d.hits, k)
		}
	}
}

// Report marks proxy reported (a verdict of the gateway's own, such as
// retireAfterSites) and reports whether it was not already: a proxy is
// reported banned once.
func (d *Detector) Report(proxy string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.reported[proxy] {
		return false
	}
	d.reported[proxy] = true
	d.forgetLocked(proxy)
	return true
}

// Forget drops what the detector holds of proxy (it left the fleet, or
// its report did not get through).
func (d *Detector) Forget(proxy string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.reported, proxy)
	d.forgetLocked(proxy)
}

func (d *Detector) forgetLocked(proxy string) {
	for k := range d.hits {
		if k.proxy == proxy {
			delete(d.hits, k)
		}
	}
}
