package web

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
	"proxyfleet/services/console/internal/access"
	"proxyfleet/services/console/internal/fleetview"
	"proxyfleet/services/console/internal/tail"
	"proxyfleet/services/console/internal/traffic"
)

// planner is a fake of the operator API at the console's seam: it keeps
// the pools and proxies it was given and refuses what the planner
// refuses (an unknown pool or proxy), and records each call.
type planner struct {
	mu      sync.Mutex
	pools   map[string]events.PoolSpec
	proxies map[string]string // id -> pool
	calls   []string
}

func newPlanner() *planner {
	return &planner{pools: map[string]events.PoolSpec{}, proxies: map[string]string{}}
}

func (p *planner) record(c string) {
	p.mu.Lock()
	p.calls = append(p.calls, c)
	p.mu.Unlock()
}

func (p *planner) Calls() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.calls...)
}

func (p *planner) PoolGet(_ context.Context, name string) (api.PoolView, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	spec, ok := p.pools[name]
	if !ok {
		return api.PoolView{}, api.NotFound("name", "unknown pool", name)
	}
	return api.PoolView{Name: name, Spec: spec.Public(), Size: spec.Size}, nil
}

func (p *planner) PoolApply(_ context.Context, spec events.PoolSpec) (api.PoolView, error) {
	p.record(fmt.Sprintf("apply %s size %d", spec.Name, spec.Size))
	p.mu.Lock()
	defer p.mu.Unlock()
	p.pools[spec.Name] = spec
	return api.PoolView{Name: spec.Name, Spec: spec.Public(), Size: spec.Size}, nil
}

func (p *planner) PoolDelete(_ context.Context, name string) (api.PoolView, error) {
	p.record("delete " + name)
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.pools[name]; !ok {
		return api.PoolView{}, api.NotFound("name", "unknown pool", name)
	}
	delete(p.pools, name)
	return api.PoolView{Name: name, Deleted: true}, nil
}

func (p *planner) Recycle(_ context.Context, req api.ProxyRecycleRequest) (events.ProxyView, error) {
	p.record("recycle " + req.ID)
	p.mu.Lock()
	defer p.mu.Unlock()
	pool, ok := p.proxies[req.ID]
	if !ok {
		return events.ProxyView{}, api.NotFound("id", "unknown proxy", req.ID)
	}
	return events.ProxyView{ID: req.ID, Pool: pool}, nil
}

func (p *planner) ReportBan(_ context.Context, req api.ProxyBanRequest) (events.ProxyView, error) {
	p.record("ban " + req.ID + " " + req.Reason)
	p.mu.Lock()
	defer p.mu.Unlock()
	pool, ok := p.proxies[req.ID]
	if !ok {
		return events.ProxyView{}, api.NotFound("id", "unknown proxy", req.ID)
	}
	return events.ProxyView{ID: req.ID, Pool: pool}, nil
}

type fixture struct {
	srv     *httptest.Server
	console *Server
	store   *fleetview.Store
	stats   *traffic.Stats
	tail    *tail.Tail
	api     *planner
}

func newFixture(t testing.TB, users access.Users) *fixture {
	t.Helper()
	store := fleetview.New()
	f := &fixture{store: store, stats: traffic.New(), tail: tail.New(0, store.PoolOf), api: newPlanner()}
	c, err := New(Config{Store: store, Traffic: f.stats, Tail: f.tail, API: f.api, Users: users, Coalesce: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	f.console = c
	f.srv = httptest.NewServer(c.Handler())
	f.srv.Config.RegisterOnShutdown(c.OnShutdown)
	t.Cleanup(func() { c.OnShutdown(); f.srv.Close() })
	return f
}

// addPool puts a pool of n proxies (every third one not ready) into the
// store and the fake planner.
func (f *fixture) addPool(name string, n int) {
	spec := events.PoolSpec{Name: name, Provider: "local", Size: n, Port: 3128}
	f.api.mu.Lock()
	f.api.pools[name] = spec
	f.api.mu.Unlock()
	now := time.Now().UTC()
	f.store.PutPool(name, &fleetview.Pool{Name: name, Provider: "local", Size: n, Spec: spec, Revision: 1, CreatedAt: now,
		Conditions: []events.Condition{{Type: events.ConditionReady, Status: events.ConditionTrue, Reason: events.ReasonEnoughReady, Since: now}}})
	for i := range n {
		id := fmt.Sprintf("%s-%06d", name, i)
		st := events.ProxyReady
		if i%3 == 2 {
			st = events.ProxyRunning
		}
		f.store.PutProxy(id, &events.ProxyView{ID: id, Pool: name, Entry: "local", Target: "t1", State: st,
			Address: "127.0.0.1:" + strconv.Itoa(20000+i%1000), Labels: map[string]string{"region": "local"}, CreatedAt: now})
		f.api.mu.Lock()
		f.api.proxies[id] = name
		f.api.mu.Unlock()
	}
}

// client is a browser's cookie handling: the session cookie is Secure,
// which Go's cookie jar does not send over plain HTTP, so it is kept here.
type client struct {
	t      testing.TB
	base   string
	cookie string
	hc     *http.Client
}

func (f *fixture) client(t testing.TB) *client {
	return &client{t: t, base: f.srv.URL, hc: &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

func (c *client) do(req *http.Request) (*http.Response, string) {
	c.t.Helper()
	if c.cookie != "" {
		req.AddCookie(&http.Cookie{Name: CookieName, Value: c.cookie})
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatal(err)
	}
	for _, ck := range resp.Cookies() {
		if ck.Name == CookieName {
			c.cookie = ck.Value
		}
	}
	return resp, string(b)
}

func (c *client) get(path string) (*http.Response, string) {
	c.t.Helper()
	req, err := http.NewRequest(http.MethodGet, c.base+path, nil)
	if err != nil {
		c.t.Fatal(err)
	}
	return c.do(req)
}

func (c *client) post(path string, form url.Values) (*http.Response, string) {
	c.t.Helper()
	req, err := http.NewRequest(http.MethodPost, c.base+path, strings.NewReader(form.Encode()))
	if err != nil {
		c.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	return c.do(req)
}

var csrfRE = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

func csrfOf(t testing.TB, body string) string {
	t.Helper()
	m := csrfRE.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no csrf token in the page:\n%s", body)
	}
	return m[1]
}

func TestFleetPageShowsPoolsWithConditionsAndCounts(t *testing.T) {
	f := newFixture(t, nil)
	f.addPool("demo", 3)
	now := time.Now().UTC()
	f.store.PutPool("bad", &fleetview.Pool{Name: "bad", Provider: "local", Size: 2, Spec: events.PoolSpec{Name: "bad", Provider: "local", Size: 2, Image: "nope"},
		Conditions: []events.Condition{{Type: events.ConditionPlaced, Status: events.ConditionFalse, Reason: events.ReasonNoTargetOffersImage,
			Message: "no live target offers image nope; local/t1 offers none", Since: now}}})
	c := f.client(t)
	resp, body := c.get("/")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /: %s\n%s", resp.Status, body)
	}
	if got := resp.Header.Get("Content-Security-Policy"); got != CSP {
		t.Errorf("CSP %q, want %q", got, CSP)
	}
	if !regexp.MustCompile(`^render;dur=[0-9]+\.[0-9]+$`).MatchString(resp.Header.Get("Server-Timing")) {
		t.Errorf("Server-Timing %q, want render;dur=<ms>", resp.Header.Get("Server-Timing"))
	}
	for _, want := range []string{
		`<tr id="pool-demo" data-desired="3" data-ready="2" data-live="3">`,
		`<tr id="pool-bad" data-desired="2" data-ready="0" data-live="0">`,
		`<span class="condition" data-type="Placed" data-status="False" data-reason="NoTargetOffersImage">Placed=False NoTargetOffersImage: no live target offers image nope; local/t1 offers none</span>`,
		`<td class="conditions">`,
		`<script src="/static/console.js" defer></script>`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("the fleet page lacks %s\n%s", want, body)
		}
	}
	if strings.Contains(body, "<script>") || strings.Contains(body, "style=") || strings.Contains(body, "<style") {
		t.Errorf("the page has inline script or style:\n%s", body)
	}
}

func TestPoolPagePagesTheProxiesByID(t *testing.T) {
	f := newFixture(t, nil)
	f.addPool("big", 250)
	c := f.client(t)
	resp, body := c.get("/pools/big")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /pools/big: %s\n%s", resp.Status, body)
	}
	for _, want := range []string{
		`<span id="count-desired">250</span>`, `<span id="count-ready">167</span>`, `<span id="count-live">250</span>`,
		`<tr id="proxy-big-000000" data-state="ready">`, `<tr id="proxy-big-000002" data-state="running">`,
		`<tr id="proxy-big-000099" data-state="ready">`,
		`<form method="post" action="/pools/big/proxies/big-000000/recycle" class="act-recycle">`,
		`<form method="post" action="/pools/big/proxies/big-000000/ban" class="act-ban">`,
		`<form method="post" action="/pools/big/scale" class="act-scale">`, `name="replicas"`,
		`<form method="post" action="/pools/big/delete" class="act-delete">`,
		`href="/pools/big?after=big-000099"`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("the pool page lacks %s", want)
		}
	}
	if strings.Contains(body, `id="proxy-big-000100"`) {
		t.Error("the first page shows a 101st proxy")
	}
	if n := strings.Count(body, `class="act-recycle"`); n != 100 {
		t.Errorf("%d recycle forms, want 100 (one per row)", n)
	}
	_, body = c.get("/pools/big?after=big-000199")
	if !strings.Contains(body, `id="proxy-big-000200"`) || strings.Contains(body, `id="proxy-big-000199"`) || !strings.Contains(body, `id="proxy-big-000249"`) {
		t.Errorf("the page after big-000199 does not hold big-000200…big-000249 only")
	}
	if strings.Contains(body, "?after=") {
		t.Error("the last page links to a next page")
	}
	// A pool the views do not hold yet: its page waits for it, live.
	resp, body = c.get("/pools/later")
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `id="pool-unknown"`) || !strings.Contains(body, `<span id="count-ready">0</span>`) || !strings.Contains(body, "<body data-live>") {
		t.Fatalf("GET /pools/later: %s\n%s", resp.Status, body)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := c.live(ctx, "/live/pools/later")
	if p := s.next(t, 5*time.Second); p != "[]" {
		t.Errorf("the first patch of an unknown pool: %s, want none", p)
	}
	f.addPool("later", 3)
	for {
		if p := s.next(t, 5*time.Second); strings.Contains(p, `count-ready\"\u003e2\u003c`) {
			break
		}
	}
	if resp, _ := c.get("/pools/Not_An_Identifier"); resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET /pools/Not_An_Identifier: %s, want 404", resp.Status)
	}
}

func TestActionsNeedConfirmationAndCSRF(t *testing.T) {
	f := newFixture(t, nil)
	f.addPool("demo", 3)
	c := f.client(t)
	_, page := c.get("/pools/demo")
	token := csrfOf(t, page)

	// No token, a wrong token: refused, nothing done.
	for _, form := range []url.Values{{}, {"csrf": {"wrong"}, "confirm": {"yes"}}} {
		resp, body := c.post("/pools/demo/proxies/demo-000001/recycle", form)
		if resp.StatusCode != http.StatusForbidden || !strings.Contains(body, "CSRF") {
			t.Errorf("recycle with csrf %q: %s, want 403 naming CSRF\n%s", form.Get("csrf"), resp.Status, body)
		}
	}
	// Another browser without this session's cookie: refused too.
	other := f.client(t)
	if resp, _ := other.post("/pools/demo/proxies/demo-000001/recycle", url.Values{"csrf": {token}, "confirm": {"yes"}}); resp.StatusCode != http.StatusForbidden {
		t.Errorf("recycle from another session with this one's token: %s, want 403", resp.Status)
	}
	if calls := f.api.Calls(); len(calls) != 0 {
		t.Fatalf("refused actions reached the API: %v", calls)
	}

	// With the token but no confirmation: a page asking to confirm.
	resp, body := c.post("/pools/demo/proxies/demo-000001/recycle", url.Values{"csrf": {token}})
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `id="confirm"`) ||
		!strings.Contains(body, `action="/pools/demo/proxies/demo-000001/recycle"`) || !strings.Contains(body, `name="confirm" value="yes"`) {
		t.Fatalf("recycle without confirm: %s, want 200 with a confirmation form\n%s", resp.Status, body)
	}
	if calls := f.api.Calls(); len(calls) != 0 {
		t.Fatalf("an unconfirmed action reached the API: %v", calls)
	}
	// Confirmed: done, and back to the pool page.
	resp, body = c.post("/pools/demo/proxies/demo-000001/recycle", url.Values{"csrf": {csrfOf(t, body)}, "confirm": {"yes"}})
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/pools/demo" {
		t.Fatalf("confirmed recycle: %s to %q, want 303 to /pools/demo\n%s", resp.Status, resp.Header.Get("Location"), body)
	}
	resp, _ = c.post("/pools/demo/proxies/demo-000002/ban", url.Values{"csrf": {token}, "confirm": {"yes"}, "reason": {"403 from example.com"}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("confirmed ban: %s", resp.Status)
	}
	resp, _ = c.post("/pools/demo/scale", url.Values{"csrf": {token}, "confirm": {"yes"}, "replicas": {"5"}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("confirmed scale: %s", resp.Status)
	}
	resp, body = c.post("/pools/demo/scale", url.Values{"csrf": {token}, "replicas": {"-1"}})
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "replicas") {
		t.Errorf("scale to -1: %s, want 400 naming replicas\n%s", resp.Status, body)
	}
	resp, _ = c.post("/pools/demo/delete", url.Values{"csrf": {token}, "confirm": {"yes"}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("confirmed delete: %s", resp.Status)
	}
	want := []string{"recycle demo-000001", "ban demo-000002 403 from example.com", "apply demo size 5", "delete demo"}
	if got := f.api.Calls(); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("API calls %q, want %q", got, want)
	}
	// The planner's refusal is shown with its status.
	resp, body = c.post("/pools/demo/delete", url.Values{"csrf": {token}, "confirm": {"yes"}})
	if resp.StatusCode != http.StatusUnprocessableEntity || !strings.Contains(body, "unknown pool") {
		t.Errorf("deleting a deleted pool: %s, want 422 with the planner's reason\n%s", resp.Status, body)
	}
}

// usersOf returns a users file of viewer "vera" and operator "otto",
// both with password "correct horse battery".
func usersOf(t testing.TB) access.Users {
	t.Helper()
	// The least cost keeps the test quick; the console's own hashes use
	// access.HashCost.
	h, err := bcrypt.GenerateFromPassword([]byte("correct horse battery"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	u, err := access.ParseUsers(strings.NewReader("vera:viewer:"+string(h)+"\notto:operator:"+string(h)+"\n"), "users")
	if err != nil {
		t.Fatal(err)
	}
	return u
}

func (c *client) login(name, password string) *http.Response {
	c.t.Helper()
	resp, _ := c.post("/login", url.Values{"username": {name}, "password": {password}})
	return resp
}

func TestUsersSignInAndViewersCannotAct(t *testing.T) {
	f := newFixture(t, usersOf(t))
	f.addPool("demo", 3)
	anon := f.client(t)
	for _, path := range []string{"/", "/pools/demo", "/targets", "/events", "/gateway"} {
		resp, _ := anon.get(path)
		if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/login" {
			t.Errorf("GET %s signed out: %s to %q, want 303 to /login", path, resp.Status, resp.Header.Get("Location"))
		}
	}
	if resp, _ := anon.get("/live/"); resp.StatusCode != http.StatusNoContent {
		t.Errorf("GET /live/ signed out: %s, want 204 (an EventSource stops)", resp.Status)
	}
	if resp := anon.login("vera", "wrong password!"); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("a wrong password: %s, want 401", resp.Status)
	}
	if resp := anon.login("nobody", "correct horse battery"); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("an unknown user: %s, want 401", resp.Status)
	}

	viewer := f.client(t)
	resp := viewer.login("vera", "correct horse battery")
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("vera signs in: %s", resp.Status)
	}
	var ck *http.Cookie
	for _, c := range resp.Cookies() {
		if c.Name == CookieName {
			ck = c
		}
	}
	if ck == nil || !ck.HttpOnly || !ck.Secure || ck.SameSite != http.SameSiteStrictMode || len(ck.Value) < 40 {
		t.Fatalf("session cookie %+v: want HttpOnly, Secure, SameSite=Strict, a long random id", ck)
	}
	_, page := viewer.get("/pools/demo")
	for _, cls := range []string{"act-recycle", "act-ban", "act-scale", "act-delete"} {
		if strings.Contains(page, cls) {
			t.Errorf("the viewer's pool page has a %s form", cls)
		}
	}
	token := csrfOf(t, page) // the sign-out form's
	for _, path := range []string{"/pools/demo/proxies/demo-000001/recycle", "/pools/demo/proxies/demo-000001/ban", "/pools/demo/scale", "/pools/demo/delete"} {
		resp, _ := viewer.post(path, url.Values{"csrf": {token}, "confirm": {"yes"}, "replicas": {"1"}})
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("viewer POST %s: %s, want 403", path, resp.Status)
		}
	}
	if calls := f.api.Calls(); len(calls) != 0 {
		t.Fatalf("a viewer's actions reached the API: %v", calls)
	}

	op := f.client(t)
	if resp := op.login("otto", "correct horse battery"); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("otto signs in: %s", resp.Status)
	}
	_, page = op.get("/pools/demo")
	if !strings.Contains(page, `class="act-recycle"`) {
		t.Fatal("the operator's pool page has no recycle form")
	}
	resp, _ = op.post("/pools/demo/proxies/demo-000001/recycle", url.Values{"csrf": {csrfOf(t, page)}, "confirm": {"yes"}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("the operator's recycle: %s", resp.Status)
	}
	// Signing out ends the session: its cookie no longer opens a page.
	resp, _ = op.post("/logout", url.Values{"csrf": {csrfOf(t, page)}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("sign out: %s", resp.Status)
	}
	if resp, _ := op.get("/"); resp.StatusCode != http.StatusSeeOther {
		t.Errorf("GET / after signing out: %s, want 303 to /login", resp.Status)
	}
}

// sse reads a live stream's patches.
type sse struct {
	resp    *http.Response
	patches chan string
}

func (c *client) live(ctx context.Context, path string) *sse {
	c.t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+path, nil)
	if err != nil {
		c.t.Fatal(err)
	}
	if c.cookie != "" {
		req.AddCookie(&http.Cookie{Name: CookieName, Value: c.cookie})
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() { resp.Body.Close() })
	s := &sse{resp: resp, patches: make(chan string, 1000)}
	go func() {
		defer close(s.patches)
		buf := make([]byte, 0, 1<<20)
		chunk := make([]byte, 64<<10)
		for {
			n, err := resp.Body.Read(chunk)
			buf = append(buf, chunk[:n]...)
			for {
				i := strings.Index(string(buf), "\n\n")
				if i < 0 {
					break
				}
				msg := string(buf[:i])
				buf = buf[i+2:]
				if strings.HasPrefix(msg, "event: patch\n") {
					s.patches <- strings.TrimPrefix(msg, "event: patch\ndata: ")
				}
			}
			if err != nil {
				return
			}
		}
	}()
	return s
}

func (s *sse) next(t testing.TB, within time.Duration) string {
	t.Helper()
	select {
	case p, ok := <-s.patches:
		if !ok {
			t.Fatal("the stream ended")
		}
		return p
	case <-time.After(within):
		t.Fatalf("no patch within %s", within)
	}
	return ""
}

func TestLivePoolPageFollowsChangesCoalesced(t *testing.T) {
	f := newFixture(t, nil)
	f.addPool("demo", 3)
	c := f.client(t)
	c.get("/pools/demo") // the session
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := c.live(ctx, "/live/pools/demo")
	if ct := s.resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("Content-Type %q", ct)
	}
	first := s.next(t, 5*time.Second)
	if !strings.Contains(first, `\u003cspan id=\"count-ready\"\u003e2\u003c/span\u003e`) || !strings.Contains(first, `"id":"pool-proxies"`) {
		t.Fatalf("the first patch does not hold the counts and proxies:\n%s", first)
	}
	// A burst of 5,000 changes: the stream sends a few patches, the last
	// one with the end state.
	for i := range 5000 {
		id := fmt.Sprintf("demo-%06d", i%3)
		f.store.PutProxy(id, &events.ProxyView{ID: id, Pool: "demo", State: events.ProxyReady, Entry: "local", Target: "t1"})
	}
	deadline := time.After(5 * time.Second)
	n := 0
	for {
		select {
		case p := <-s.patches:
			n++
			if strings.Contains(p, `count-ready\"\u003e3\u003c`) {
				if n > 20 {
					t.Errorf("%d patches for a burst of 5000 changes: not coalesced", n)
				}
				return
			}
		case <-deadline:
			t.Fatalf("no patch with 3 ready within 5s (%d patches)", n)
		}
	}
}

func TestScaleRefusedWhereAnApplyWouldNotScale(t *testing.T) {
	f := newFixture(t, nil)
	f.addPool("auto", 2)
	sum, _ := f.store.Pool("auto", time.Now())
	p := *sum.Pool
	p.Spec.Autoscale = &events.Autoscale{Min: 1, Max: 5, TargetConnections: 4}
	f.store.PutPool("auto", &p)
	c := f.client(t)
	_, page := c.get("/pools/auto")
	if strings.Contains(page, `class="act-scale"`) || !strings.Contains(page, "autoscales between its min and max") {
		t.Errorf("an autoscaled pool's page offers to scale it, or does not say why not")
	}
	if !strings.Contains(page, `class="act-delete"`) || !strings.Contains(page, `class="act-recycle"`) {
		t.Errorf("an autoscaled pool's page lacks its other actions")
	}
	resp, body := c.post("/pools/auto/scale", url.Values{"csrf": {csrfOf(t, page)}, "replicas": {"4"}, "confirm": {"yes"}})
	if resp.StatusCode != http.StatusConflict || !strings.Contains(body, "autoscale bounds") {
		t.Errorf("scaling an autoscaled pool: %s, want 409 saying why\n%s", resp.Status, body)
	}
	if calls := f.api.Calls(); len(calls) != 0 {
		t.Errorf("the refused scale reached the API: %v", calls)
	}
}
