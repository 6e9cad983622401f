package fleet

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/testnet"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/gateway/internal/forward"
	"proxyfleet/services/gateway/internal/reqlog"
	"proxyfleet/services/gateway/internal/route"
)

// boughtProxy is an upstream HTTP proxy as a seller runs one
// ([testnet.AuthProxy]: plain requests and CONNECT behind its own
// basic-auth pair, recording every Proxy-Authorization it is sent), with
// the pair it demands.
type boughtProxy struct {
	*testnet.AuthProxy
	user, pass string
	addr       string
}

func newBoughtProxy(t *testing.T, user, pass string) *boughtProxy {
	t.Helper()
	p := testnet.NewAuthProxy(t, user, user, pass)
	return &boughtProxy{AuthProxy: p, user: user, pass: pass, addr: p.Addr}
}

// pairs returns the credentials the proxy was sent, and how often it
// served and refused.
func (p *boughtProxy) pairs() (seen map[string]int, served, rejected int) { return p.Pairs() }

// TestExternalPoolRelaysWithEachProxysCredentials runs the gateway (its
// NATS side and its server) on an embedded NATS server before three
// bought proxies with distinct credentials: plain HTTP, CONNECT tunnels
// and intercepted HTTPS through the external pools reach every member,
// each with its own credentials and never another's; a disabled member
// gets no traffic; the credentials appear neither in the request log's
// records nor in the gateway's log; a retire verdict on a member reaches
// the planner as report-ban.
func TestExternalPoolRelaysWithEachProxysCredentials(t *testing.T) {
	conn := bustest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	key, err := seal.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	pools, proxies, creds := bucket(t, conn, bus.BucketPools), bucket(t, conn, bus.BucketProxies), bucket(t, conn, bus.BucketGatewayCreds)

	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/banned" {
			w.WriteHeader(http.StatusForbidden)
			_, _ = io.WriteString(w, "captcha")
			return
		}
		_, _ = io.WriteString(w, "plain page")
	}))
	defer origin.Close()
	tlsOrigin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "secure page") }))
	defer tlsOrigin.Close()
	originRoots := x509.NewCertPool()
	originRoots.AddCert(tlsOrigin.Certificate())

	bought := []*boughtProxy{
		newBoughtProxy(t, "alice", "pw-alice-101"),
		newBoughtProxy(t, "bob", "pw-bob-103"),
		newBoughtProxy(t, "carol", "pw-carol-107"),
	}
	disabled := newBoughtProxy(t, "dave", "pw-dave-109")
	secrets := []string{"pw-alice-101", "pw-bob-103", "pw-carol-107", "pw-dave-109"}

	// Two external pools over the same sellers: ext tunnels CONNECT,
	// extx intercepts it. dave's proxy is disabled in both.
	x := events.ProviderExternal
	for _, pool := range []string{"ext", "extx"} {
		spec := events.PoolSpec{Name: pool, Provider: x, External: &events.External{}, Gateway: &events.GatewaySpec{Intercept: pool == "extx",
			BanRules: []events.BanRule{{Name: "captcha", Status: []int{http.StatusForbidden}, Body: "captcha", Action: events.BanActionRetire, Threshold: 1}}}}
		secret := events.ProbeSecret{Pool: pool, External: map[string]events.ProxyAuth{}}
		for i, b := range append(bought, disabled) {
			spec.External.Proxies = append(spec.External.Proxies, events.ExternalProxy{URL: "http://" + b.addr})
			secret.External[b.addr] = events.ProxyAuth{Username: b.user, Password: b.pass}
			state := events.ProxyReady
			if b == disabled {
				state = events.ProxyDisabled
			}
			id := pool + "-" + string(rune('a'+i))
			put(t, proxies, id, events.ProxyView{ID: id, Pool: pool, Entry: x, Target: x, State: state, Address: b.addr,
				DisabledUntil: map[bool]time.Time{true: time.Now().Add(time.Hour)}[b == disabled]})
		}
		spec.Size = len(spec.External.Proxies)
		put(t, pools, pool, map[string]any{"name": pool, "provider": x, "spec": spec})
		plain, _ := json.Marshal(secret)
		box, err := seal.Seal(plain, seal.Public(key))
		if err != nil {
			t.Fatal(err)
		}
		put(t, creds, pool, events.ProbeCredential{Revision: 1, Sealed: *box})
	}

	var logs logLines
	log := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	var recMu sync.Mutex
	var records []string
	sub, err := conn.NC.Subscribe(events.GatewayLogSubject("gw1"), func(m *nats.Msg) {
		recMu.Lock()
		records = append(records, string(m.Data))
		recMu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	rl, err := reqlog.New(conn.NC, reqlog.Config{Gateway: "gw1", Sample: 1, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	caOut := filepath.Join(t.TempDir(), "ca.pem")
	table := route.NewTable(route.Limits{}, nil)
	f, err := New(conn, table, Config{Name: "gw1", Key: key, CAOut: caOut}, log)
	if err != nil {
		t.Fatal(err)
	}
	srv := forward.New(forward.Config{Table: table, Fleet: f, Auth: func(string, string, string) (bool, error) { return true, nil },
		Log: log, CA: f, OriginRoots: originRoots, RequestLog: rl, DialTimeout: 5 * time.Second, ResponseTimeout: 10 * time.Second})
	defer srv.Close()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { _ = f.Run(ctx, srv) })
	wg.Go(func() { _ = rl.Run(ctx) })
	gw := httptest.NewServer(srv)
	defer gw.Close()
	select {
	case <-f.Synced():
	case <-time.After(20 * time.Second):
		t.Fatal("not synced within 20s")
	}
	testwait.Until(t, 20*time.Second, "the CA loaded and the credentials opened", func() bool {
		_, err := os.Stat(caOut)
		u, pw, cerr := f.Credentials(route.Proxy{ID: "ext-a", Pool: "ext", Address: bought[0].addr})
		return err == nil && cerr == nil && u == "alice" && pw == "pw-alice-101"
	})
	gwRoots := x509.NewCertPool()
	caPEM, err := os.ReadFile(caOut)
	if err != nil || !gwRoots.AppendCertsFromPEM(caPEM) {
		t.Fatalf("gateway CA certificate: %v", err)
	}

	served := map[string]int{} // by X-Proxyfleet-Proxy
	client := func(pool string, roots *x509.CertPool) *http.Client {
		tr := &http.Transport{
			Proxy:             http.ProxyURL(&url.URL{Scheme: "http", User: url.UserPassword(pool, "client-pw"), Host: gw.Listener.Addr().String()}),
			TLSClientConfig:   &tls.Config{RootCAs: roots},
			DisableKeepAlives: true, // a new tunnel, so a new pick, each time
			OnProxyConnectResponse: func(_ context.Context, _ *url.URL, _ *http.Request, resp *http.Response) error {
				if id := resp.Header.Get(forward.ProxyHeader); id != "" {
					served[id]++
				}
				return nil
			},
		}
		t.Cleanup(tr.CloseIdleConnections)
		return &http.Client{Transport: tr, Timeout: 20 * time.Second}
	}
	get := func(c *http.Client, u, want string) {
		t.Helper()
		resp, err := c.Get(u)
		if err != nil {
			t.Fatalf("GET %s: %v", u, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || string(body) != want {
			t.Fatalf("GET %s: %d %q; want 200 %q", u, resp.StatusCode, body, want)
		}
		if id := resp.Header.Get(forward.ProxyHeader); id != "" {
			served[id]++
		}
	}
	plainClient, tunnelClient, interceptClient := client("ext", nil), client("ext", originRoots), client("extx", gwRoots)
	for range 9 {
		get(plainClient, origin.URL+"/page", "plain page")
		get(tunnelClient, tlsOrigin.URL+"/page", "secure page")
		get(interceptClient, tlsOrigin.URL+"/page", "secure page")
	}

	for i, b := range bought {
		seen, n, rejected := b.pairs()
		if rejected != 0 || n == 0 {
			t.Errorf("%s's proxy served %d and refused %d requests; want some served, none refused", b.user, n, rejected)
		}
		for pair := range seen {
			if pair != b.user+":"+b.pass {
				t.Errorf("%s's proxy was sent the credentials of another: %q", b.user, strings.SplitN(pair, ":", 2)[0])
			}
		}
		for _, pool := range []string{"ext", "extx"} {
			if id := pool + "-" + string(rune('a'+i)); served[id] == 0 {
				t.Errorf("%s served nothing (served: %v); want every ready member used", id, served)
			}
		}
	}
	if seen, _, _ := disabled.pairs(); len(seen) != 0 {
		t.Errorf("the disabled member got requests: %v", seen)
	}
	if served["ext-d"]+served["extx-d"] != 0 {
		t.Errorf("the disabled member answered: %v", served)
	}

	testwait.Until(t, 20*time.Second, "the request log's records", func() bool {
		recMu.Lock()
		defer recMu.Unlock()
		return len(records) >= 27
	})
	recMu.Lock()
	all := strings.Join(records, "\n")
	recMu.Unlock()
	if !strings.Contains(all, `"pool":"extx"`) || !strings.Contains(all, `"proxies":["ext-a"]`) {
		t.Fatalf("the request log does not record the pools and proxies: %.2000s", all)
	}
	for _, s := range secrets {
		if strings.Contains(all, s) || strings.Contains(logs.String(), s) {
			t.Fatalf("the credential %q appears in the request log or the gateway's log", s)
		}
	}
	for _, u := range []string{"alice", "bob", "carol"} {
		if strings.Contains(all, u+":") || strings.Contains(logs.String(), u+":") {
			t.Fatalf("a user:password pair of %s appears in the request log or the gateway's log", u)
		}
	}

	// A retire verdict on an external proxy reaches the planner as
	// report-ban, as for any proxy (the planner disables it).
	bans := make(chan api.ProxyBanRequest, 16)
	bsub, err := conn.NC.Subscribe(events.APISubject(api.NounProxy, api.VerbReportBan), func(m *nats.Msg) {
		var b api.ProxyBanRequest
		_ = json.Unmarshal(m.Data, &b)
		bans <- b
		_ = m.Respond([]byte(`{}`))
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = bsub.Unsubscribe() }()
	resp, err := plainClient.Get(origin.URL + "/banned")
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	select {
	case b := <-bans:
		if b.Reason != "captcha" || !strings.HasPrefix(b.ID, "ext-") || b.ID == "ext-d" {
			t.Errorf("report-ban %+v; want a ready member of ext, rule captcha", b)
		}
	case <-time.After(20 * time.Second):
		t.Error("no report-ban for the external proxy that got the ban page")
	}
}
