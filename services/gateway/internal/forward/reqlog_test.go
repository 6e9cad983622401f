package forward

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/gateway/internal/reqlog"
	"proxyfleet/services/gateway/internal/route"
)

// TestRequestLogOneRecordPerRequest serves requests through a gateway
// whose first proxy is dead, with the request log on a real server: each
// client request gives exactly one record, naming the proxies tried in
// order (the first one failed over), its status, bytes and outcome, and
// no query string, client password or proxy credential.
func TestRequestLogOneRecordPerRequest(t *testing.T) {
	if reqlog.ProxyHeader != ProxyHeader {
		t.Fatalf("reqlog.ProxyHeader %q, want forward.ProxyHeader %q", reqlog.ProxyHeader, ProxyHeader)
	}
	got, logger, ctx := startRequestLog(t)
	var records []events.GatewayRequest
	site := origin(t, func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("hello")) })
	tlsSite := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("secure")) }))
	t.Cleanup(tlsSite.Close)
	dead := newUpstream(t, "crawl:proxy-secret")
	fleet := &recordingFleet{user: "crawl", password: "proxy-secret"}
	table := route.NewTable(route.Limits{}, nil)
	table.Set(route.Proxy{ID: "p-a", Pool: "p", Address: dead.addr()})
	table.Set(route.Proxy{ID: "p-b", Pool: "p", Address: newUpstream(t, "crawl:proxy-secret").addr()})
	dead.srv.Close()
	srv := New(Config{Table: table, Fleet: fleet, Auth: func(_, _, pw string) (bool, error) { return pw == "client-secret", nil },
		DialTimeout: 2 * time.Second, ResponseTimeout: 10 * time.Second, RequestLog: logger})
	gw := httptest.NewServer(srv)
	t.Cleanup(gw.Close)
	t.Cleanup(srv.Close)
	h := &harness{t: t, gw: gw}
	client := func(user string) *http.Client {
		c := h.client(user)
		pu := *mustURL(gw.URL)
		pu.User = url.UserPassword(user, "client-secret")
		c.Transport.(*http.Transport).Proxy = http.ProxyURL(&pu)
		return c
	}

	// 1: fails over from p-a to p-b. 2: p-a cools, p-b at once. 3: a
	// tunnel. 4: a pool that does not exist.
	if code, body, _ := get(t, client("p.session-s1"), site.URL+"/a/b?token=x"); code != 200 || body != "hello" {
		t.Fatalf("GET: %d %q", code, body)
	}
	if code, _, _ := get(t, client("p"), site.URL+"/c"); code != 200 {
		t.Fatalf("GET: %d", code)
	}
	tc := client("p")
	if code, body, _ := get(t, tc, tlsSite.URL+"/secret?token=y"); code != 200 || body != "secure" {
		t.Fatalf("GET through a tunnel: %d %q", code, body)
	}
	tc.Transport.(*http.Transport).CloseIdleConnections() // the tunnel closes, its record follows
	if code, _, _ := get(t, client("nopool"), site.URL+"/"); code != http.StatusNotFound {
		t.Fatalf("GET of an unknown pool: %d", code)
	}
	for len(records) < 4 {
		select {
		case r := <-got:
			records = append(records, r)
		case <-ctx.Done():
			t.Fatalf("records: %d of 4: %+v", len(records), records)
		}
	}
	select {
	case r := <-got:
		t.Fatalf("a fifth record for four requests: %+v", r)
	case <-time.After(300 * time.Millisecond):
	}
	siteHost := strings.TrimPrefix(site.URL, "http://")
	tlsHost := strings.TrimPrefix(tlsSite.URL, "https://")
	byPath := map[string]events.GatewayRequest{}
	for _, r := range records {
		byPath[r.Method+" "+r.Host+r.Path+" "+r.Pool] = r
		if r.Gateway != "gw" || r.Time.IsZero() || r.DurationMS <= 0 {
			t.Errorf("record %+v: want gateway gw, a time and a duration", r)
		}
	}
	check := func(key string, want events.GatewayRequest) {
		t.Helper()
		r, ok := byPath[key]
		if !ok {
			t.Errorf("no record %q among %+v", key, records)
			return
		}
		if r.Session != want.Session || r.Site != want.Site || r.Scheme != want.Scheme || strings.Join(r.Proxies, ",") != strings.Join(want.Proxies, ",") ||
			r.Attempts != len(want.Proxies) || r.Status != want.Status || r.Outcome != want.Outcome || (want.BytesDown > 0 && r.BytesDown != want.BytesDown) {
			t.Errorf("record %q: %+v\nwant %+v", key, r, want)
		}
	}
	check("GET "+siteHost+"/a/b p", events.GatewayRequest{Session: "s1", Site: "127.0.0.1", Scheme: "http", Proxies: []string{"p-a", "p-b"}, Status: 200, Outcome: events.RequestOK, BytesDown: 5})
	check("GET "+siteHost+"/c p", events.GatewayRequest{Site: "127.0.0.1", Scheme: "http", Proxies: []string{"p-b"}, Status: 200, Outcome: events.RequestOK, BytesDown: 5})
	check("CONNECT "+tlsHost+" p", events.GatewayRequest{Site: "127.0.0.1", Proxies: []string{"p-b"}, Status: 200, Outcome: events.RequestOK})
	check("GET "+siteHost+"/ nopool", events.GatewayRequest{Site: "127.0.0.1", Scheme: "http", Proxies: []string{}, Status: 404, Outcome: events.RequestError})
	if r := byPath["CONNECT "+tlsHost+" p"]; r.BytesUp == 0 || r.BytesDown == 0 {
		t.Errorf("the tunnel's record carried no bytes: %+v", r)
	}
}

// startRequestLog starts a request log on an embedded NATS server and
// returns the records published, as they arrive; every record is checked
// for query strings and credentials.
func startRequestLog(t *testing.T) (<-chan events.GatewayRequest, *reqlog.Logger, context.Context) {
	t.Helper()
	conn := bustest.Start(t)
	ctx := testwait.Context(t, 30*time.Second)
	if err := bus.EnsureTopology(ctx, conn); err != nil {
		t.Fatal(err)
	}
	got := make(chan events.GatewayRequest, 64)
	sub, err := conn.NC.Subscribe(events.GatewayLogAll, func(m *nats.Msg) {
		var r events.GatewayRequest
		if err := json.Unmarshal(m.Data, &r); err != nil {
			t.Errorf("record %s: %v", m.Data, err)
		}
		if strings.Contains(string(m.Data), "token") || strings.Contains(string(m.Data), "proxy-secret") || strings.Contains(string(m.Data), "client-secret") {
			t.Errorf("record holds a query string or a credential: %s", m.Data)
		}
		got <- r
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	logger, err := reqlog.New(conn.NC, reqlog.Config{Gateway: "gw", Sample: 1})
	if err != nil {
		t.Fatal(err)
	}
	lctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- logger.Run(lctx) }()
	t.Cleanup(func() { stop(); <-done })
	return got, logger, ctx
}

// TestRequestLogOfInterceptedRequests: through an intercepting pool the
// CONNECT has its record (the tunnel opened) and each HTTPS request inside
// one of its own, with its path (no query), proxies and status.
func TestRequestLogOfInterceptedRequests(t *testing.T) {
	got, logger, ctx := startRequestLog(t)
	originCA, gwCA := newTestCA(t, time.Now()), newTestCA(t, time.Now())
	site := tlsOrigin(t, originCA, "127.0.0.1", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "secure") })
	h := newInterceptHarnessLogged(t, &recordingFleet{}, nil, gwCA, originCA, logger, newUpstream(t, ""), newUpstream(t, ""))
	c := h.trusting("p.session-s9", gwCA.pool)
	for _, path := range []string{"/one?token=a", "/two"} {
		if code, body, _ := get(t, c, site.URL+path); code != 200 || body != "secure" {
			t.Fatalf("GET %s: %d %q", path, code, body)
		}
	}
	c.Transport.(*http.Transport).CloseIdleConnections()
	byKey := map[string]events.GatewayRequest{}
	for len(byKey) < 3 {
		select {
		case r := <-got:
			byKey[r.Method+" "+r.Scheme+" "+r.Path] = r
		case <-ctx.Done():
			t.Fatalf("records: %d of 3: %+v", len(byKey), byKey)
		}
	}
	host := strings.TrimPrefix(site.URL, "https://")
	for _, k := range []string{"GET https /one", "GET https /two"} {
		r, ok := byKey[k]
		if !ok || r.Host != host || r.Pool != "p" || r.Session != "s9" || r.Site != "127.0.0.1" || r.Attempts != 1 || len(r.Proxies) != 1 || r.Status != 200 || r.Outcome != events.RequestOK || r.BytesDown != int64(len("secure")) {
			t.Errorf("record %q: %+v (found %v); want host %s, pool p, session s9, one proxy, 200 ok, 6 bytes", k, r, ok, host)
		}
	}
	if r, ok := byKey["CONNECT  "]; !ok || r.Host != host || r.Status != 200 || r.Outcome != events.RequestOK || r.Attempts != 0 {
		t.Errorf("the CONNECT's record: %+v (found %v); want the tunnel opened (200 ok, no proxy: the requests inside have their own)", r, ok)
	}
}
