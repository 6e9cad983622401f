package e2e_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testwait"
)

// sitePages is how many pages the crawled site has besides its index.
const sitePages = 200

// crawlSite is a site of sitePages pages linked as a binary tree (page i
// links to 2i+1 and 2i+2) with links to the next page and to the index,
// so a crawler starting at / finds every page, most of them several
// times. It counts the requests it serves per path.
type crawlSite struct {
	addr string

	mu       sync.Mutex
	hits     map[string]int
	withAuth int // requests that still carried Proxy-Authorization
}

func startCrawlSite(t *testing.T) *crawlSite {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &crawlSite{addr: ln.Addr().String(), hits: map[string]int{}}
	srv := &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return s
}

func (s *crawlSite) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.hits[r.URL.Path]++
	if r.Header.Get("Proxy-Authorization") != "" {
		s.withAuth++
	}
	s.mu.Unlock()
	servePage(w, r, sitePages)
}

// servePage answers r with page r.URL.Path of a site of pages pages
// linked as a binary tree (page i links to 2i+1 and 2i+2), to the next
// page and to the index; false (and a 404) for any other path.
func servePage(w http.ResponseWriter, r *http.Request, pages int) bool {
	var links []int
	switch {
	case r.URL.Path == "/":
		links = []int{0}
	default:
		var i int
		if _, err := fmt.Sscanf(r.URL.Path, "/p/%d", &i); err != nil || i < 0 || i >= pages || r.URL.Path != fmt.Sprintf("/p/%d", i) {
			http.NotFound(w, r)
			return false
		}
		for _, j := range []int{2*i + 1, 2*i + 2, (i + 1) % pages} {
			if j < pages {
				links = append(links, j)
			}
		}
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	fmt.Fprintf(w, "<!doctype html><title>%s</title><body><a href=\"/\">home</a>", r.URL.Path)
	for _, j := range links {
		fmt.Fprintf(w, " <a href=\"/p/%d\">page %d</a>", j, j)
	}
	fmt.Fprint(w, "</body>\n")
	return true
}

// sitePaths are the paths a full crawl fetches: the index and every page.
func sitePaths() []string { return pagePaths(sitePages) }

// pagePaths are the paths of a site of pages pages (servePage): the index
// and every page.
func pagePaths(pages int) []string {
	paths := []string{"/"}
	for i := 0; i < pages; i++ {
		paths = append(paths, fmt.Sprintf("/p/%d", i))
	}
	return paths
}

// gatewayAt finds the gateway's address in make run's banner.
var gatewayAt = regexp.MustCompile(`crawler gateway at http://([0-9.]+:[0-9]+) `)

// TestGatewayScrapy is the gateway's acceptance by a real crawler: Scrapy
// from Debian's python3-scrapy, with HTTP_PROXY naming make run's gateway
// and pool demo of 3 proxies, crawls a local site of 200 pages. Every page
// must be fetched once, through one of the pool's ready proxies, and the
// gateway's round-robin must spread the pages over all three. The gateway
// tier (make test-gateway-scrapy) installs Scrapy and sets
// PROXYFLEET_SCRAPY; without it the test is skipped.
func TestGatewayScrapy(t *testing.T) {
	scrapy := os.Getenv("PROXYFLEET_SCRAPY")
	if scrapy == "" {
		t.Skip("PROXYFLEET_SCRAPY is not set; make test-gateway-scrapy runs this test with Debian's scrapy")
	}
	testgate.NeedFile(t, scrapy, "install Debian's python3-scrapy (make scrapy-install)")
	spider, err := filepath.Abs(filepath.Join("testdata", "scrapy", "site_spider.py"))
	if err != nil {
		t.Fatal(err)
	}

	site := startCrawlSite(t)
	r := startRunScript(t,
		"PLANNER_FLAGS=--reconcile-interval 200ms",
		"HEALTH_FLAGS=--probe-interval 300ms --probe-timeout 2s",
		"AGENT_FLAGS=--target t1 --capacity 5 --egress-allow "+site.addr,
	)
	banner := r.waitBanner()
	m := gatewayAt.FindStringSubmatch(banner)
	if m == nil {
		t.Fatalf("no gateway address in the banner:\n%s", banner)
	}
	gateway := m[1]
	env := bannerLine(t, banner, ". ")
	apply := bannerLine(t, banner, `nats req fleet.api.pool.apply '{"name":"demo","provider":"local","size":3}'`)
	list := bannerLine(t, banner, "nats req fleet.api.proxy.list")
	stats := bannerLine(t, banner, "nats req fleet.gateway.")
	info := strings.Replace(stats, ".stats ", ".info ", 1)
	if out, err := r.shell(env + " && " + apply); err != nil {
		t.Fatalf("%s: %v\n%s", apply, err, out)
	}

	// Ready in the fleet's view, then in the gateway's routing table.
	ready := map[string]bool{}
	waitFor(t, 90*time.Second, "the pool's 3 proxies to be ready", func() bool {
		var proxies struct {
			Proxies []proxyView `json:"proxies"`
		}
		out, err := r.shell(env + " && " + list)
		if err != nil || json.Unmarshal([]byte(out), &proxies) != nil || len(proxies.Proxies) != 3 {
			return false
		}
		ids := map[string]bool{}
		for _, p := range proxies.Proxies {
			if p.State != "ready" {
				return false
			}
			ids[p.ID] = true
		}
		ready = ids
		return true
	})
	waitFor(t, 30*time.Second, "the gateway to route to the 3 ready proxies", func() bool {
		var gi struct {
			Pools map[string]struct {
				Ready []string `json:"ready"`
			} `json:"pools"`
		}
		out, err := r.shell(env + " && " + info)
		if err != nil || json.Unmarshal([]byte(out), &gi) != nil {
			return false
		}
		got := gi.Pools["demo"].Ready
		if len(got) != len(ready) {
			return false
		}
		for _, id := range got {
			if !ready[id] {
				return false
			}
		}
		return true
	})

	// Scrapy as a user runs it: Debian's python, no proxy but the gateway.
	work := t.TempDir()
	out := filepath.Join(work, "out.jsonl")
	ctx := testwait.Context(t, 5*time.Minute)
	cmd := exec.CommandContext(ctx, scrapy, "runspider", spider, "-a", "start=http://"+site.addr+"/", "-o", out)
	cmd.Dir = work
	proxyURL := "http://demo:x@" + gateway
	cmd.Env = []string{
		"PATH=/usr/bin:/bin",
		"HOME=" + work,
		"LANG=C.UTF-8",
		"PYTHONDONTWRITEBYTECODE=1",
		"HTTP_PROXY=" + proxyURL,
		"http_proxy=" + proxyURL,
	}
	var stderr bytes.Buffer
	cmd.Stdout = &stderr
	cmd.Stderr = &stderr
	start := time.Now()
	runErr := cmd.Run()
	took := time.Since(start)
	t.Cleanup(func() {
		if t.Failed() {
			tail := stderr.Bytes()
			if len(tail) > 8000 {
				tail = tail[len(tail)-8000:]
			}
			t.Logf("---- scrapy output (tail) ----\n%s", tail)
		}
	})
	if runErr != nil {
		t.Fatalf("scrapy runspider: %v (after %s)", runErr, took.Round(time.Millisecond))
	}

	// What the crawler got.
	type item struct {
		URL    string `json:"url"`
		Status int    `json:"status"`
		Proxy  string `json:"proxy"`
	}
	f, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fetched := map[string]int{}
	perProxy := map[string]int{}
	var items int
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var it item
		if err := json.Unmarshal(sc.Bytes(), &it); err != nil {
			t.Fatalf("%s: %q: %v", out, sc.Text(), err)
		}
		items++
		path := strings.TrimPrefix(it.URL, "http://"+site.addr)
		fetched[path]++
		perProxy[it.Proxy]++
		if it.Status != http.StatusOK {
			t.Errorf("%s: status %d, want 200", it.URL, it.Status)
		}
		if !ready[it.Proxy] {
			t.Errorf("%s: carried by proxy %q, want one of the pool's ready proxies %v", it.URL, it.Proxy, keys(ready))
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	want := sitePaths()
	for _, p := range want {
		if fetched[p] != 1 {
			t.Errorf("scrapy has %d items for %s, want 1", fetched[p], p)
		}
	}
	if items != len(want) {
		t.Errorf("scrapy wrote %d items, want %d (the index and %d pages)", items, len(want), sitePages)
	}

	// What the site saw: each page once, nothing else, and never the
	// client's proxy credentials.
	site.mu.Lock()
	hits, total, withAuth := map[string]int{}, 0, site.withAuth
	for p, n := range site.hits {
		hits[p] = n
		total += n
	}
	site.mu.Unlock()
	for _, p := range want {
		if hits[p] != 1 {
			t.Errorf("the site served %s %d times, want 1", p, hits[p])
		}
	}
	if total != len(want) {
		t.Errorf("the site served %d requests, want %d: %v", total, len(want), hits)
	}
	if withAuth != 0 {
		t.Errorf("%d requests reached the site with a Proxy-Authorization header", withAuth)
	}

	// The spread: round-robin per request gives each proxy a third.
	ids := keys(ready)
	var spread []string
	for _, id := range ids {
		spread = append(spread, fmt.Sprintf("%s=%d", id, perProxy[id]))
	}
	t.Logf("scrapy fetched %d pages in %s; pages per proxy: %s", items, took.Round(time.Millisecond), strings.Join(spread, " "))
	for _, id := range ids {
		if n := perProxy[id]; n*5 < len(want) {
			t.Errorf("proxy %s carried %d of %d pages, want at least 20%% (spread %s)", id, n, len(want), strings.Join(spread, " "))
		}
	}

	// The gateway counted what the crawler saw.
	var gs struct {
		Pools map[string]struct {
			Requests int64 `json:"requests"`
			Errors   int64 `json:"errors"`
			Proxies  map[string]struct {
				Requests int64 `json:"requests"`
			} `json:"proxies"`
		} `json:"pools"`
	}
	sout, err := r.shell(env + " && " + stats)
	if err != nil {
		t.Fatalf("%s: %v\n%s", stats, err, sout)
	}
	if err := json.Unmarshal([]byte(sout), &gs); err != nil {
		t.Fatalf("%s: %v\n%s", stats, err, sout)
	}
	demo := gs.Pools["demo"]
	if demo.Requests != int64(len(want)) || demo.Errors != 0 {
		t.Errorf("gateway stats for demo: %d requests, %d errors; want %d and 0\n%s", demo.Requests, demo.Errors, len(want), sout)
	}
	for _, id := range ids {
		if got := demo.Proxies[id].Requests; got != int64(perProxy[id]) {
			t.Errorf("gateway stats: proxy %s carried %d requests, scrapy saw %d", id, got, perProxy[id])
		}
	}
}

// keys returns m's keys in order.
func keys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
