package browser

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/heapprofiler"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/performance"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
)

// EnvAxe names axe-core's axe.min.js (make test-console installs it into
// the cache and sets it).
const EnvAxe = "PROXYFLEET_AXE"

// ReadAxe reads the axe-core script $PROXYFLEET_AXE names.
func ReadAxe() ([]byte, error) {
	p := os.Getenv(EnvAxe)
	if p == "" {
		return nil, fmt.Errorf("%s is not set: make test-console installs axe-core and sets it to its axe.min.js", EnvAxe)
	}
	src, err := os.ReadFile(p)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", EnvAxe, err)
	}
	return src, nil
}

// Violation is one rule axe-core found broken, with the elements that
// break it.
type Violation struct {
	ID     string `json:"id"`
	Impact string `json:"impact"` // minor, moderate, serious or critical
	Help   string `json:"help"`
	Nodes  []struct {
		Target         []any  `json:"target"`
		HTML           string `json:"html"`
		FailureSummary string `json:"failureSummary"`
	} `json:"nodes"`
}

// String is the violation as a test prints it: rule, impact, what it asks
// for, and each element with why it fails.
func (v Violation) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s (%s): %s", v.ID, v.Impact, v.Help)
	for _, n := range v.Nodes {
		fmt.Fprintf(&b, "\n    %v %s\n      %s", n.Target, n.HTML, strings.ReplaceAll(n.FailureSummary, "\n", "\n      "))
	}
	return b.String()
}

// Severe reports whether the violation's impact is serious or critical.
func (v Violation) Severe() bool { return v.Impact == "serious" || v.Impact == "critical" }

// Axe injects axe-core (the script [ReadAxe] returns) into the tab's page
// through the DevTools protocol, which the page's Content-Security-Policy
// does not govern, and runs it on the whole document: the violations it
// reports, of every impact.
func Axe(ctx context.Context, script []byte) ([]Violation, error) {
	if err := chromedp.Do(ctx, chromedp.Evaluate[chromedp.Void](string(script))); err != nil {
		return nil, fmt.Errorf("inject axe-core: %w", err)
	}
	s, err := chromedp.Run(ctx, chromedp.Evaluate[string](
		`axe.run(document, {resultTypes: ['violations']}).then(r => JSON.stringify(r.violations))`,
		chromedp.EvalAwaitPromise))
	if err != nil {
		return nil, fmt.Errorf("run axe-core: %w", err)
	}
	var out []Violation
	if err := json.Unmarshal([]byte(s), &out); err != nil {
		return nil, fmt.Errorf("axe-core's violations: %w", err)
	}
	return out, nil
}

// Memory is what the tab's page holds after a forced garbage collection.
type Memory struct {
	HeapUsed  int64 // bytes of the JavaScript heap in use (Runtime.getHeapUsage)
	HeapTotal int64 // bytes the heap has allocated
	Nodes     int64 // DOM nodes alive (Performance.getMetrics "Nodes")
	Listeners int64 // JavaScript event listeners ("JSEventListeners")
	Documents int64 // documents alive ("Documents")
}

func (m Memory) String() string {
	return fmt.Sprintf("JS heap %.2f MiB used of %.2f MiB, %d DOM nodes, %d listeners, %d documents",
		float64(m.HeapUsed)/(1<<20), float64(m.HeapTotal)/(1<<20), m.Nodes, m.Listeners, m.Documents)
}

// MeasureMemory forces a garbage collection in the tab
// (HeapProfiler.collectGarbage) and reads the JavaScript heap in use and
// the page's DOM and listener counts.
func MeasureMemory(ctx context.Context) (Memory, error) {
	var m Memory
	err := chromedp.Do(ctx, chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		if _, err := cdp.Call(ctx, t, heapprofiler.CollectGarbage, cdp.Empty{}); err != nil {
			return fmt.Errorf("collect garbage: %w", err)
		}
		heap, err := cdp.Call(ctx, t, runtime.GetHeapUsage, cdp.Empty{})
		if err != nil {
			return fmt.Errorf("heap usage: %w", err)
		}
		m.HeapUsed, m.HeapTotal = int64(heap.UsedSize), int64(heap.TotalSize)
		if _, err := cdp.Call(ctx, t, performance.Enable, performance.EnableParams{}); err != nil {
			return fmt.Errorf("performance metrics: %w", err)
		}
		metrics, err := cdp.Call(ctx, t, performance.GetMetrics, cdp.Empty{})
		if err != nil {
			return fmt.Errorf("performance metrics: %w", err)
		}
		for _, pm := range metrics.Metrics {
			switch pm.Name {
			case "Nodes":
				m.Nodes = int64(pm.Value)
			case "JSEventListeners":
				m.Listeners = int64(pm.Value)
			case "Documents":
				m.Documents = int64(pm.Value)
			}
		}
		return nil
	}))
	return m, err
}

// ServerTiming returns the durations (milliseconds) of the current
// document's Server-Timing header as the browser received it with the
// navigation, by metric name: what the server says it spent, not a
// measure of the test's.
func ServerTiming(ctx context.Context) (map[string]float64, error) {
	s, err := chromedp.Run(ctx, chromedp.Evaluate[string](
		`JSON.stringify(Object.fromEntries(performance.getEntriesByType('navigation')[0].serverTiming.map(e => [e.name, e.duration])))`))
	if err != nil {
		return nil, fmt.Errorf("read Server-Timing: %w", err)
	}
	out := map[string]float64{}
	if err := json.Unmarshal([]byte(s), &out); err != nil {
		return nil, fmt.Errorf("Server-Timing: %w", err)
	}
	return out, nil
}

// Screenshot is a PNG of the tab's whole page, beyond the window too.
func Screenshot(ctx context.Context) ([]byte, error) {
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		return nil, fmt.Errorf("screenshot: %w", err)
	}
	return png, nil
}

// Problems collects what a tab's pages report as errors — uncaught
// exceptions, console.error calls and the browser's own error entries (a
// Content-Security-Policy violation, a failed request) — and every request
// they make for a URL outside loopback. The browser's own background
// requests (Chromium still asks its update and account hosts at start,
// flags notwithstanding; the guard refuses them) are not a tab's and are
// not listed. The favicon the browser asks each site for is not a page's
// request either: its 404 is left out.
type Problems struct {
	mu      sync.Mutex
	msgs    []string
	outside []string
	expect  []string // URLs whose failures a test caused on purpose
}

// Expect leaves out the failures of requests for url (a refusal the test
// asked for on purpose, e.g. a POST it expects to be refused).
func (p *Problems) Expect(url string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.expect = append(p.expect, url)
}

func (p *Problems) expected(url string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, u := range p.expect {
		if u == url {
			return true
		}
	}
	return false
}

// WatchProblems starts collecting the tab's errors and outside requests
// until ctx ends. Start it before the navigation it should cover.
func WatchProblems(ctx context.Context) *Problems {
	p := &Problems{}
	msgs := chromedp.Console(ctx)
	requests := chromedp.Events(ctx, network.RequestWillBeSent)
	go func() {
		for m, err := range msgs {
			if err != nil {
				return
			}
			if (m.IsException() || m.Type == chromedp.ConsoleError) && !strings.HasSuffix(m.URL, "/favicon.ico") && !p.expected(m.URL) {
				p.mu.Lock()
				p.msgs = append(p.msgs, fmt.Sprintf("%s (%s:%d)", m.String(), m.URL, m.Line+1))
				p.mu.Unlock()
			}
		}
	}()
	go func() {
		for ev, err := range requests {
			if err != nil {
				return
			}
			if ev.Request == nil || IsLoopbackURL(ev.Request.URL) {
				continue
			}
			p.mu.Lock()
			p.outside = append(p.outside, ev.Request.URL)
			p.mu.Unlock()
		}
	}()
	return p
}

// List returns the errors collected so far.
func (p *Problems) List() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.msgs...)
}

// Outside returns the URLs outside loopback the tab's pages requested so
// far (each ended at the guard).
func (p *Problems) Outside() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.outside...)
}

// IsLoopbackURL reports whether u is a page the browser may load: on
// loopback (127.0.0.0/8, [::1], localhost), or one that needs no network
// (about:, data:, blob:).
func IsLoopbackURL(u string) bool {
	pu, err := url.Parse(u)
	if err != nil {
		return false
	}
	switch pu.Scheme {
	case "about", "data", "blob":
		return true
	case "http", "https", "ws", "wss":
	default:
		return false
	}
	host := pu.Hostname()
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
