package e2e_test

import (
	"bufio"
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testwait"
)

// httpsPages is how many pages each HTTPS site has besides its index.
const httpsPages = 300

// The proxies' source addresses (local-agent --source-addrs): the sites
// ban by client address, so each proxy is told apart by its own. One
// more than the pool's size: the banned proxy's replacement sends from
// the one no proxy uses (the agent gives the least used).
var proxySources = []string{"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"}

// bannedSource is the address the sites ban.
const bannedSource = "127.0.0.2"

// httpsSite is a crawlable HTTPS site (pages linked as in crawlSite) with
// a certificate of its own CA, which bans client addresses: a banned
// address gets a 403 captcha page. It counts the pages it served (200)
// and the ban pages per client address.
type httpsSite struct {
	addr   string
	banned atomic.Pointer[map[string]bool]

	mu     sync.Mutex
	served map[string]int // 200s per path
	bans   map[string]int // 403s per client address
	from   map[string]int // 200s per client address
}

// testCA is a certificate authority of the test's own: the sites'
// certificates, which the gateway trusts by --origin-ca.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "proxyfleet e2e sites CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// leaf issues a server certificate for ip.
func (ca *testCA) leaf(t *testing.T, ip string) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: ip},
		IPAddresses:  []net.IP{net.ParseIP(ip)},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// startHTTPSSite serves a site on ip (a loopback address) with a
// certificate of ca.
func startHTTPSSite(t *testing.T, ca *testCA, ip string) *httpsSite {
	t.Helper()
	ln, err := net.Listen("tcp", ip+":0")
	if err != nil {
		t.Fatal(err)
	}
	s := &httpsSite{addr: ln.Addr().String(), served: map[string]int{}, bans: map[string]int{}, from: map[string]int{}}
	s.ban()
	srv := &http.Server{
		Handler:           s,
		ReadHeaderTimeout: 10 * time.Second,
		TLSConfig:         &tls.Config{Certificates: []tls.Certificate{ca.leaf(t, ip)}, NextProtos: []string{"http/1.1"}},
	}
	go func() { _ = srv.ServeTLS(ln, "", "") }()
	t.Cleanup(func() { _ = srv.Close() })
	return s
}

// ban sets the client addresses the site bans (none without arguments).
func (s *httpsSite) ban(addrs ...string) {
	m := map[string]bool{}
	for _, a := range addrs {
		m[a] = true
	}
	s.banned.Store(&m)
}

func (s *httpsSite) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	client, _, _ := net.SplitHostPort(r.RemoteAddr)
	if (*s.banned.Load())[client] {
		s.mu.Lock()
		s.bans[client]++
		s.mu.Unlock()
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.WriteHeader(http.StatusForbidden)
		fmt.Fprint(w, "<!doctype html><title>Are you a robot?</title><body>Solve this captcha to continue.</body>\n")
		return
	}
	if r.URL.Path == "/whoami" {
		fmt.Fprint(w, client)
		return
	}
	if !servePage(w, r, httpsPages) {
		return
	}
	s.mu.Lock()
	s.served[r.URL.Path]++
	s.from[client]++
	s.mu.Unlock()
}

// httpsPaths are the paths a full crawl fetches.
func httpsPaths() []string { return pagePaths(httpsPages) }

// counts returns copies of the site's counters.
func (s *httpsSite) counts() (served, bans, from map[string]int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	cp := func(m map[string]int) map[string]int {
		out := make(map[string]int, len(m))
		for k, v := range m {
			out[k] = v
		}
		return out
	}
	return cp(s.served), cp(s.bans), cp(s.from)
}

// crawlItem is one page a crawler wrote: Scrapy's spider and Crawlee's
// script write the same fields.
type crawlItem struct {
	URL      string `json:"url"`
	Status   int    `json:"status"`
	Proxy    string `json:"proxy"`
	Attempts int    `json:"attempts"`
	Error    string `json:"error"`
}

func readItems(t *testing.T, path string) []crawlItem {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var items []crawlItem
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var it crawlItem
		if err := json.Unmarshal(sc.Bytes(), &it); err != nil {
			t.Fatalf("%s: %q: %v", path, sc.Text(), err)
		}
		items = append(items, it)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return items
}

// checkCrawl checks what a crawler got of site: every page once, each a
// 200 carried by one of the pool's proxies, no ban page; and what the site
// served: each page once.
func checkCrawl(t *testing.T, who string, items []crawlItem, site *httpsSite, ready map[string]bool) map[string]int {
	t.Helper()
	perProxy := map[string]int{}
	fetched := map[string]int{}
	for _, it := range items {
		path := strings.TrimPrefix(it.URL, "https://"+site.addr)
		fetched[path]++
		perProxy[it.Proxy]++
		if it.Status != http.StatusOK {
			t.Errorf("%s: %s: status %d (%s), want 200: no ban page delivered", who, it.URL, it.Status, it.Error)
		}
		if !ready[it.Proxy] {
			t.Errorf("%s: %s: carried by %q, want one of the pool's proxies %v", who, it.URL, it.Proxy, keys(ready))
		}
		if it.Attempts < 1 {
			t.Errorf("%s: %s: X-Proxyfleet-Attempts %d, want 1 or more", who, it.URL, it.Attempts)
		}
	}
	for _, p := range httpsPaths() {
		if fetched[p] != 1 {
			t.Errorf("%s has %d items for %s, want 1", who, fetched[p], p)
		}
	}
	if len(items) != len(httpsPaths()) {
		t.Errorf("%s wrote %d items, want %d", who, len(items), len(httpsPaths()))
	}
	served, _, _ := site.counts()
	for _, p := range httpsPaths() {
		if served[p] != 1 {
			t.Errorf("after %s the site served %s %d times, want 1", who, p, served[p])
		}
	}
	return perProxy
}

// caFileIn finds the gateway CA file make run's banner names.
var caFileIn = regexp.MustCompile(`(\S+gateway-ca\.pem)`)

// TestGatewayHTTPSCrawl is the acceptance of the gateway's interception by
// real crawlers: Scrapy (Debian's) and Crawlee (npm, pinned; its
// SessionPool's sessions mapped to gateway sessions) each crawl an HTTPS
// site of 300 pages through make run's gateway and an intercepting pool
// of 3 local proxies with distinct source addresses, while the site bans
// one proxy's address with a 403 captcha page:
//   - every page is fetched once and no ban page reaches a crawler (the
//     gateway retries a banned answer on another proxy);
//   - the banned proxy is cooled for that site only: it still serves a
//     second site;
//   - once the second site bans it too (retireAfterSites 2), it is
//     retired and replaced;
//   - a client that does not trust the gateway's CA fails its handshake
//     at once.
//
// make test-gateway-https installs both crawlers and sets
// PROXYFLEET_SCRAPY and PROXYFLEET_CRAWLEE_DIR; without them the test is
// skipped.
func TestGatewayHTTPSCrawl(t *testing.T) {
	scrapy, crawleeDir := os.Getenv("PROXYFLEET_SCRAPY"), os.Getenv("PROXYFLEET_CRAWLEE_DIR")
	if scrapy == "" || crawleeDir == "" {
		t.Skip("PROXYFLEET_SCRAPY or PROXYFLEET_CRAWLEE_DIR is not set; make test-gateway-https runs this test with Debian's scrapy and the pinned Crawlee")
	}
	testgate.NeedFile(t, scrapy, "install Debian's python3-scrapy (make scrapy-install)")
	testgate.NeedFile(t, filepath.Join(crawleeDir, "node_modules", "@crawlee", "cheerio"), "install the pinned Crawlee (make crawlee-install)")
	node := testgate.NeedBinary(t, "node", "make crawlee-install installs Debian's nodejs")

	ca := newTestCA(t)
	siteCA := filepath.Join(t.TempDir(), "sites-ca.pem")
	if err := os.WriteFile(siteCA, ca.pem, 0o644); err != nil {
		t.Fatal(err)
	}
	// Two sites, two registrable "domains" (an IP is its own site).
	first := startHTTPSSite(t, ca, "127.0.0.1")
	second := startHTTPSSite(t, ca, "127.0.0.6")
	first.ban(bannedSource)

	r := startRunScript(t,
		"PLANNER_FLAGS=--reconcile-interval 200ms",
		"HEALTH_FLAGS=--probe-interval 300ms --probe-timeout 2s",
		"AGENT_FLAGS=--target t1 --capacity 6 --source-addrs "+strings.Join(proxySources, ",")+" --egress-allow "+first.addr+","+second.addr,
		"GATEWAY_FLAGS=--origin-ca "+siteCA,
	)
	banner := r.waitBanner()
	m := gatewayAt.FindStringSubmatch(banner)
	if m == nil {
		t.Fatalf("no gateway address in the banner:\n%s", banner)
	}
	gateway := m[1]
	cm := caFileIn.FindStringSubmatch(banner)
	if cm == nil {
		t.Fatalf("no gateway CA file in the banner:\n%s", banner)
	}
	gatewayCA := cm[1]
	if !filepath.IsAbs(gatewayCA) {
		gatewayCA = filepath.Join(r.runDir, "..", gatewayCA)
	}
	env := bannerLine(t, banner, ". ")
	list := bannerLine(t, banner, "nats req fleet.api.proxy.list")
	spec := `{"name":"demo","provider":"local","size":3,"gateway":{"intercept":true,"retries":2,"retireAfterSites":2,` +
		`"banRules":[{"name":"captcha","status":[403],"body":"(?i)captcha","action":"cooldown","cooldown":"30m","threshold":1}]}}`
	if out, err := r.shell(env + " && nats req fleet.api.pool.apply '" + spec + "'"); err != nil || strings.Contains(out, `"error"`) {
		t.Fatalf("pool.apply: %v\n%s", err, out)
	}

	proxies := func() []proxyView {
		var pl struct {
			Proxies []proxyView `json:"proxies"`
		}
		out, err := r.shell(env + " && " + list)
		if err != nil || json.Unmarshal([]byte(out), &pl) != nil {
			return nil
		}
		return pl.Proxies
	}
	ready := map[string]bool{}
	waitFor(t, 90*time.Second, "the pool's 3 proxies to be ready", func() bool {
		ps := proxies()
		n := 0
		ids := map[string]bool{}
		for _, p := range ps {
			if p.State == "ready" {
				n++
				ids[p.ID] = true
			}
		}
		ready = ids
		return n == 3
	})

	// The gateway's CA, as a crawler gets it from make run.
	caPEM, err := os.ReadFile(gatewayCA)
	if err != nil {
		t.Fatalf("the gateway CA file the banner names: %v", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatalf("%s holds no certificate", gatewayCA)
	}
	client := func(user string, roots *x509.CertPool) *http.Client {
		return &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
			Proxy:           http.ProxyURL(&url.URL{Scheme: "http", User: url.UserPassword(user, "x"), Host: gateway}),
			TLSClientConfig: &tls.Config{RootCAs: roots},
		}}
	}
	trusting := client("demo", roots)

	// Which proxy sends from the banned address: the second site tells
	// each request's client address. Routed per request, so a few
	// requests meet all three once the gateway routes to them.
	source := map[string]string{} // proxy id -> source address
	waitFor(t, 60*time.Second, "the gateway to carry requests through all 3 proxies", func() bool {
		resp, err := trusting.Get("https://" + second.addr + "/whoami")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var b bytes.Buffer
		_, _ = b.ReadFrom(resp.Body)
		if id := resp.Header.Get("X-Proxyfleet-Proxy"); resp.StatusCode == http.StatusOK && ready[id] {
			source[id] = b.String()
		}
		return len(source) == 3
	})
	var banned string
	for id, a := range source {
		if a == bannedSource {
			banned = id
		}
	}
	if banned == "" {
		t.Fatalf("no proxy sends from %s: %v", bannedSource, source)
	}
	t.Logf("proxy %s sends from %s, which the sites ban", banned, bannedSource)

	// Scrapy crawls the first site, which bans that proxy.
	work := t.TempDir()
	spider, err := filepath.Abs(filepath.Join("testdata", "scrapy", "site_spider.py"))
	if err != nil {
		t.Fatal(err)
	}
	scrapyOut := filepath.Join(work, "scrapy.jsonl")
	ctx := testwait.Context(t, 5*time.Minute)
	proxyURL := "http://demo:x@" + gateway
	cmd := exec.CommandContext(ctx, scrapy, "runspider", spider, "-a", "start=https://"+first.addr+"/", "-o", scrapyOut)
	cmd.Dir = work
	cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=" + work, "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1",
		"HTTPS_PROXY=" + proxyURL, "https_proxy=" + proxyURL}
	runCrawler(t, "scrapy", cmd)
	perProxy := checkCrawl(t, "scrapy", readItems(t, scrapyOut), first, ready)
	t.Logf("scrapy pages per proxy: %v", perProxy)
	if perProxy[banned] != 0 {
		t.Errorf("scrapy got %d pages through the banned proxy %s, want 0", perProxy[banned], banned)
	}
	if _, bans, _ := first.counts(); bans[bannedSource] == 0 {
		t.Errorf("the first site banned nobody: the test proves nothing")
	}

	// Cooled for the first site only: it still serves the second.
	carried := map[string]int{}
	for range 12 {
		resp, err := trusting.Get("https://" + second.addr + "/")
		if err != nil {
			t.Fatalf("GET the second site: %v", err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET the second site: %s", resp.Status)
		}
		carried[resp.Header.Get("X-Proxyfleet-Proxy")]++
	}
	if carried[banned] == 0 {
		t.Errorf("the proxy banned by the first site carried none of 12 requests to the second: %v (cooled for one site only)", carried)
	}
	for range 6 {
		resp, err := trusting.Get("https://" + first.addr + "/p/1")
		if err != nil {
			t.Fatalf("GET the first site: %v", err)
		}
		_ = resp.Body.Close()
		if id := resp.Header.Get("X-Proxyfleet-Proxy"); id == banned || resp.Header.Get("X-Proxyfleet-Attempts") != "1" {
			t.Errorf("GET the first site after the crawl: proxy %s, attempts %s; want another proxy than %s at the first attempt (cooled)", id, resp.Header.Get("X-Proxyfleet-Attempts"), banned)
		}
	}

	// Crawlee crawls the second site, which now bans the proxy too: the
	// second site it is cooled on retires it.
	second.ban(bannedSource)
	script := filepath.Join(work, "crawl.mjs")
	src, err := os.ReadFile(filepath.Join("testdata", "crawlee", "crawl.mjs"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(script, src, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(crawleeDir, "node_modules"), filepath.Join(work, "node_modules")); err != nil {
		t.Fatal(err)
	}
	crawleeOut := filepath.Join(work, "crawlee.jsonl")
	// The second site served "/" to the requests above: only the crawl counts.
	second.mu.Lock()
	clear(second.served)
	second.mu.Unlock()
	cmd = exec.CommandContext(ctx, node, script, "--start", "https://"+second.addr+"/", "--gateway", gateway, "--pool", "demo", "--out", crawleeOut)
	cmd.Dir = work
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + work, "NODE_EXTRA_CA_CERTS=" + gatewayCA, "CRAWLEE_STORAGE_DIR=" + filepath.Join(work, "storage")}
	runCrawler(t, "crawlee", cmd)
	// The proxy's replacement may carry pages too.
	pool := map[string]bool{}
	for _, p := range proxies() {
		pool[p.ID] = true
	}
	perProxy = checkCrawl(t, "crawlee", readItems(t, crawleeOut), second, pool)
	t.Logf("crawlee pages per proxy: %v", perProxy)
	if _, bans, _ := second.counts(); bans[bannedSource] == 0 {
		t.Errorf("the second site banned nobody during crawlee's crawl: the test proves nothing")
	}

	// Banned on two sites: retired and replaced.
	var replacement string
	waitFor(t, 60*time.Second, "the proxy banned on two sites to be retired and replaced", func() bool {
		// Retired: no longer ready, or gone from the list once deleted.
		retired, readyNow := true, 0
		for _, p := range proxies() {
			if p.ID == banned && p.State == "ready" {
				retired = false
			}
			if p.ID != banned && p.State == "ready" {
				readyNow++
				if !ready[p.ID] {
					replacement = p.ID
				}
			}
		}
		return retired && readyNow == 3
	})

	t.Logf("proxy %s replaced by %s", banned, replacement)

	// A client that does not trust the gateway's CA fails at once.
	start := time.Now()
	_, err = client("demo", x509.NewCertPool()).Get("https://" + first.addr + "/")
	var unknown x509.UnknownAuthorityError
	if !errors.As(err, &unknown) {
		t.Errorf("GET without the gateway's CA: got %v, want an unknown-authority failure", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("GET without the gateway's CA took %s to fail, want at once", took)
	}
}

// runCrawler runs a crawler to its end, showing its output on failure.
func runCrawler(t *testing.T, name string, cmd *exec.Cmd) {
	t.Helper()
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	start := time.Now()
	err := cmd.Run()
	t.Logf("%s ran %s", name, time.Since(start).Round(time.Millisecond))
	if err != nil {
		tail := out.Bytes()
		if len(tail) > 8000 {
			tail = tail[len(tail)-8000:]
		}
		t.Fatalf("%s: %v\n%s", name, err, tail)
	}
}
