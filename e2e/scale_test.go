package e2e_test

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/events"
)

// TestTenThousandProxyPoolConverges: a pool of 10,000 proxies on an instant
// backend (every instance runs the moment it is created, all behind one
// loopback forward proxy) becomes ready through the real planner and health
// binaries, with exactly one request per proxy and not a single unhealthy
// verdict on the way.
func TestTenThousandProxyPoolConverges(t *testing.T) {
	if testing.Short() {
		t.Skip("converges a 10,000-proxy pool")
	}
	const size = 10_000
	f := newFleet(t)
	f.startPlanner()
	// Default probing: the fleet must be probed at its own pace.
	f.start("health", "--echo-addr", "127.0.0.1:0")
	drv := agenttest.NewInstant(forwardProxy(t))
	rt, err := agent.New(f.conn, drv, agent.Config{Info: agent.Info{Entry: "instant", Target: "t1", Type: "instant"}}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	agenttest.Serve(t, rt.Run)
	f.waitAgent("instant", "t1")
	f.waitLeader()

	start := time.Now()
	f.mustReq("fleet.api.pool.apply", fmt.Sprintf(`{"name":"big","provider":"instant","size":%d}`, size))
	var ready int
	var states map[string]int
	defer func() {
		if t.Failed() {
			t.Logf("pool big: %v; backend instances: %d", states, drv.Len())
		}
	}()
	waitFor(t, 6*time.Minute, fmt.Sprintf("%d ready proxies in pool big", size), func() bool {
		var pv struct {
			States map[string]int `json:"states"`
		}
		r := f.req("fleet.api.pool.get", `{"name":"big"}`, nil)
		if r.Code != "" {
			return false
		}
		parseJSON(t, r.Data, &pv)
		states = pv.States
		ready = pv.States[events.ProxyReady]
		return ready == size
	})
	t.Logf("%d proxies ready %s after the apply", size, time.Since(start).Round(time.Millisecond))
	if n := drv.Len(); n != size {
		t.Errorf("the backend holds %d instances, want %d", n, size)
	}
	if n := f.eventCount("fleet.evt.proxy.*." + events.ProxyRequested); n != size {
		t.Errorf("%d proxies requested, want exactly %d", n, size)
	}
	if n := f.eventCount("fleet.evt.proxy.*." + events.ProxyUnhealthy); n != 0 {
		t.Errorf("%d unhealthy verdicts while converging, want none", n)
	}
}

// forwardProxy serves plain HTTP forwarding and CONNECT tunnels on a
// loopback port, as every proxy of a fleet does, and returns its address.
func forwardProxy(t *testing.T) string {
	t.Helper()
	tr := &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodConnect {
			up, err := (&net.Dialer{Timeout: 5 * time.Second}).DialContext(r.Context(), "tcp", r.Host)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			down, buf, err := http.NewResponseController(w).Hijack()
			if err != nil {
				up.Close()
				return
			}
			if _, err := down.Write([]byte("HTTP/1.1 200 Connection established\r\n\r\n")); err != nil {
				up.Close()
				down.Close()
				return
			}
			go func() { _, _ = io.Copy(up, buf); up.Close() }()
			_, _ = io.Copy(down, up)
			down.Close()
			return
		}
		out, err := http.NewRequestWithContext(r.Context(), r.Method, r.URL.String(), r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		resp, err := tr.RoundTrip(out)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		for k, vs := range resp.Header {
			w.Header()[k] = vs
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = io.Copy(w, resp.Body)
	}))
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}
