// Package ban recognises banned proxies by the responses they relay: a
// pool's ban rules (events.BanRule) match a response by status, header or
// body, and a rule that matches Threshold responses of one proxy within
// its Window reports that proxy banned, once.
//
// It holds no I/O: the gateway shows it each plain HTTP response
// ([Detector.Observe]) and calls the planner's report-ban API with the
// verdicts it returns.
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
	threshold   int
	window      time.Duration
}

// Compile checks and compiles a pool's rules (the pool spec validated
// them already; an error here means a spec that skipped validation).
func Compile(rules []events.BanRule) ([]Rule, error) {
	out := make([]Rule, 0, len(rules))
	for _, r := range rules {
		c := Rule{Name: r.Name, status: slices.Clone(r.Status), header: http.CanonicalHeaderKey(r.Header),
			threshold: r.ThresholdOrDefault(), window: r.WindowOrDefault()}
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
	// Matches is how many responses matched within the window.
	Matches int
}

// Detector counts rule matches per proxy. It is safe for concurrent use.
type Detector struct {
	now func() time.Time

	mu sync.Mutex
	// hits holds, per proxy and rule, the times of the matches within
	// the rule's window.
	hits map[key][]time.Time
	// reported holds the proxies already reported: one verdict per
	// proxy, as the planner retires it at the first.
	reported map[string]bool
}

type key struct{ proxy, rule string }

// NewDetector returns a detector; now is the clock (time.Now when nil).
func NewDetector(now func() time.Time) *Detector {
	if now == nil {
		now = time.Now
	}
	return &Detector{now: now, hits: map[key][]time.Time{}, reported: map[string]bool{}}
}

// Observe counts one response of proxy against rules and returns the
// verdict of the first rule that reached its threshold, if any. A proxy
// is reported once; [Detector.Forget] clears it when it leaves the fleet.
func (d *Detector) Observe(proxy string, rules []Rule, status int, header http.Header, body []byte) (Verdict, bool) {
	now := d.now()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.reported[proxy] {
		return Verdict{}, false
	}
	for _, r := range rules {
		if !r.Matches(status, header, body) {
			continue
		}
		k := key{proxy, r.Name}
		times := d.hits[k]
		cut := 0
		for cut < len(times) && now.Sub(times[cut]) >= r.window {
			cut++
		}
		times = append(times[cut:], now)
		if len(times) >= r.threshold {
			d.reported[proxy] = true
			d.forgetLocked(proxy)
			return Verdict{Proxy: proxy, Rule: r.Name, Matches: len(times)}, true
		}
		d.hits[k] = times
	}
	return Verdict{}, false
}

// Forget drops what the detector holds of proxy (it left the fleet).
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
