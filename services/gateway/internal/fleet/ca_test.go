package fleet

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/gateway/internal/forward"
	"proxyfleet/services/gateway/internal/intercept"
	"proxyfleet/services/gateway/internal/route"
)

// runGateway runs one gateway's fleet side on conn until the test ends.
func runGateway(t *testing.T, conn *bus.Conn, name string, key []byte, caOut string) *Fleet {
	t.Helper()
	kp, err := seal.LoadOrCreate(writeSeed(t, key))
	if err != nil {
		t.Fatal(err)
	}
	table := route.NewTable(route.Limits{}, nil)
	f, err := New(conn, table, Config{Name: name, Key: kp, Listen: "127.0.0.1:8888", CAOut: caOut}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	srv := forward.New(forward.Config{Table: table, Fleet: f, Auth: func(string, string, string) (bool, error) { return true, nil }})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = f.Run(ctx, srv) }()
	t.Cleanup(func() { cancel(); <-done })
	return f
}

// writeSeed writes a curve seed file (a new key when seed is nil) and
// returns its path.
func writeSeed(t *testing.T, seed []byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "gateway.xk")
	if seed == nil {
		kp, err := seal.NewKey()
		if err != nil {
			t.Fatal(err)
		}
		seed, _ = kp.Seed()
	}
	if err := os.WriteFile(path, seed, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func newSeed(t *testing.T) []byte {
	t.Helper()
	kp, err := seal.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := kp.Seed()
	return seed
}

// TestGatewaysShareOneCA: two gateways with one --key-file start at once
// on an empty bucket; each ends with the same CA, the certificate is
// served on fleet.gateway.<name>.ca and written to --ca-out (0644).
func TestGatewaysShareOneCA(t *testing.T) {
	conn := bustest.Start(t)
	seed := newSeed(t)
	out := filepath.Join(t.TempDir(), "gateway-ca.pem")
	g1 := runGateway(t, conn, "gw1", seed, out)
	g2 := runGateway(t, bustest.Dial(t, conn), "gw2", seed, "")
	var p1, p2 []byte
	testwait.Until(t, 20*time.Second, "both gateways to load the CA", func() bool {
		var e1, e2 error
		p1, e1 = g1.CAPEM()
		p2, e2 = g2.CAPEM()
		return e1 == nil && e2 == nil
	})
	if !bytes.Equal(p1, p2) {
		t.Fatalf("the two gateways hold different CAs:\n%s\n%s", p1, p2)
	}
	kv := bucket(t, conn, bus.BucketGatewayCA)
	e, err := kv.Get(context.Background(), CACertKey)
	if err != nil || !bytes.Equal(e.Value(), p1) {
		t.Fatalf("bucket cert %q, %v; want the gateways' CA", e.Value(), err)
	}
	// The key in the bucket is sealed, not plain.
	if e, err := kv.Get(context.Background(), CAKeyKey); err != nil || bytes.Contains(e.Value(), []byte("PRIVATE KEY")) || !bytes.Contains(e.Value(), []byte(`"box"`)) {
		t.Fatalf("bucket key: %v; want a sealed box", err)
	}
	// Leaves of either gateway verify against the one CA.
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(p1)
	for _, g := range []*Fleet{g1, g2} {
		iss, err := g.Issuer()
		if err != nil {
			t.Fatal(err)
		}
		leaf, err := iss.Certificate("example.test")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := leaf.Leaf.Verify(x509.VerifyOptions{DNSName: "example.test", Roots: pool}); err != nil {
			t.Errorf("a leaf does not verify against the shared CA: %v", err)
		}
	}
	m, err := conn.NC.Request(events.GatewaySubject("gw2", events.GatewayCA), nil, 10*time.Second)
	if err != nil || !bytes.Equal(m.Data, p1) {
		t.Errorf("fleet.gateway.gw2.ca answered %q, %v; want the CA's PEM", m.Data, err)
	}
	testwait.Until(t, 10*time.Second, "--ca-out to be written", func() bool {
		b, err := os.ReadFile(out)
		return err == nil && bytes.Equal(b, p1)
	})
	if fi, err := os.Stat(out); err != nil || fi.Mode().Perm() != 0o644 {
		t.Errorf("--ca-out mode: %v %v; want 0644", fi.Mode().Perm(), err)
	}
}

// TestCACreationRaces: many gateways (one key) create the CA at once on
// an empty bucket; all end with one key and one certificate.
func TestCACreationRaces(t *testing.T) {
	conn := bustest.Start(t)
	kv := bucket(t, conn, bus.BucketGatewayCA)
	key, _ := seal.NewKey()
	const racers = 8
	got := make([][]byte, racers)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range racers {
		wg.Go(func() {
			<-start
			ca, err := LoadOrCreateCA(context.Background(), kv, key, time.Now())
			if err != nil {
				t.Error(err)
				return
			}
			got[i] = ca.PEM()
		})
	}
	close(start)
	wg.Wait()
	for i := range got {
		if !bytes.Equal(got[i], got[0]) {
			t.Fatalf("racer %d holds another CA than racer 0", i)
		}
	}
}

// TestCAAfterACrashBetweenTheCreates: a gateway that stopped after it
// created the key but before the certificate left the key alone; the
// next gateway signs a certificate with that key.
func TestCAAfterACrashBetweenTheCreates(t *testing.T) {
	conn := bustest.Start(t)
	ctx := context.Background()
	kv := bucket(t, conn, bus.BucketGatewayCA)
	key, _ := seal.NewKey()
	der, err := intercept.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	box, _ := seal.Seal(der, seal.Public(key))
	put(t, kv, CAKeyKey, box)
	ca, err := LoadOrCreateCA(ctx, kv, key, time.Now())
	if err != nil {
		t.Fatalf("CA from a lone key: %v", err)
	}
	// The certificate is the stored key's.
	if _, err := intercept.ParseCA(ca.PEM(), der); err != nil {
		t.Errorf("the new certificate is not the stored key's: %v", err)
	}
	again, err := LoadOrCreateCA(ctx, kv, key, time.Now())
	if err != nil || !bytes.Equal(again.PEM(), ca.PEM()) {
		t.Errorf("a second load: %v; want the same certificate", err)
	}
}

// TestCASealedToAnotherKey: a gateway whose --key-file differs from the
// CA creator's cannot open the CA: it says why, and intercepting pools
// would get that reason; its other work goes on.
func TestCASealedToAnotherKey(t *testing.T) {
	conn := bustest.Start(t)
	first := runGateway(t, conn, "gw1", newSeed(t), "")
	testwait.Until(t, 20*time.Second, "the first gateway to create the CA", func() bool { _, err := first.CAPEM(); return err == nil })
	other := runGateway(t, bustest.Dial(t, conn), "gw2", newSeed(t), "")
	var err error
	testwait.Until(t, 20*time.Second, "the second gateway to fail to open the CA", func() bool {
		_, err = other.Issuer()
		return err != nil && err != errCALoading
	})
	if !strings.Contains(err.Error(), "sealed to another gateway key") || !strings.Contains(err.Error(), "--key-file") {
		t.Errorf("error: %v; want it to say the CA key is sealed to another key and name --key-file", err)
	}
	m, rerr := conn.NC.Request(events.GatewaySubject("gw2", events.GatewayCA), nil, 10*time.Second)
	if rerr != nil || m.Header.Get(micro.ErrorCodeHeader) != "503" || !strings.Contains(m.Header.Get(micro.ErrorHeader), "--key-file") {
		t.Errorf("ca endpoint of the gateway with another key: %v %v; want a 503 naming --key-file", m, rerr)
	}
}

// connectProxy is a minimal forward proxy on loopback that tunnels
// CONNECT, standing for a proxy of the fleet.
func connectProxy(t *testing.T) string {
	t.Helper()
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodConnect {
			http.Error(w, "CONNECT only", http.StatusMethodNotAllowed)
			return
		}
		up, err := net.Dial("tcp", r.Host)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusOK)
		down, rw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			_ = up.Close()
			return
		}
		if n := rw.Reader.Buffered(); n > 0 {
			b, _ := rw.Reader.Peek(n)
			_, _ = up.Write(b)
		}
		go func() { _, _ = io.Copy(up, down); _ = up.Close() }()
		_, _ = io.Copy(down, up)
		_ = down.Close()
	}))
	t.Cleanup(s.Close)
	return s.Listener.Addr().String()
}

// TestInterceptThroughTheFleet wires the gateway as its main does: a pool
// with gateway.intercept in fleet-pools, a ready proxy, the CA the fleet
// side loads; a client trusting the PEM the ca endpoint answers gets an
// HTTPS page through the pool, with the proxy named.
func TestInterceptThroughTheFleet(t *testing.T) {
	conn := bustest.Start(t)
	site := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "secure") }))
	t.Cleanup(site.Close)
	originRoots := x509.NewCertPool()
	originRoots.AddCert(site.Certificate())

	put(t, bucket(t, conn, bus.BucketPools), "p", map[string]any{"name": "p", "spec": events.PoolSpec{Name: "p", Provider: "local", Size: 1,
		Gateway: &events.GatewaySpec{Intercept: true}}})
	put(t, bucket(t, conn, bus.BucketProxies), "p-a", events.ProxyView{ID: "p-a", Pool: "p", State: events.ProxyReady, Address: connectProxy(t)})

	key, _ := seal.NewKey()
	table := route.NewTable(route.Limits{}, nil)
	f, err := New(conn, table, Config{Name: "gw1", Key: key, Listen: "127.0.0.1:8888"}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	srv := forward.New(forward.Config{Table: table, Fleet: f, Auth: func(string, string, string) (bool, error) { return true, nil },
		CA: f, OriginRoots: originRoots})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = f.Run(ctx, srv) }()
	t.Cleanup(func() { cancel(); <-done; srv.Close() })
	gw := httptest.NewServer(srv)
	t.Cleanup(gw.Close)

	var caPEM []byte
	testwait.Until(t, 20*time.Second, "the ca endpoint to answer the CA and pool p to be loaded", func() bool {
		m, err := conn.NC.Request(events.GatewaySubject("gw1", events.GatewayCA), nil, 5*time.Second)
		if err != nil || m.Header.Get(micro.ErrorCodeHeader) != "" {
			return false
		}
		caPEM = m.Data
		return f.Known("p") && len(table.IDs()) == 1
	})
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatalf("the ca endpoint answered no PEM certificate: %q", caPEM)
	}
	proxyURL, _ := url.Parse(gw.URL)
	proxyURL.User = url.UserPassword("p", "x")
	tr := &http.Transport{Proxy: http.ProxyURL(proxyURL), TLSClientConfig: &tls.Config{RootCAs: roots}}
	t.Cleanup(tr.CloseIdleConnections)
	resp, err := (&http.Client{Transport: tr, Timeout: 20 * time.Second}).Get(site.URL + "/")
	if err != nil {
		t.Fatalf("HTTPS through the intercepting pool, trusting the fleet's CA: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "secure" || resp.Header.Get(forward.ProxyHeader) != "p-a" {
		t.Errorf("through the intercepting pool: %d %q via %q; want 200 secure via p-a", resp.StatusCode, body, resp.Header.Get(forward.ProxyHeader))
	}
}
