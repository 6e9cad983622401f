// Command instantagent is the agent of the end-to-end converge benchmark
// (BenchmarkConvergeEndToEnd): the real agent runtime of package
// pkg/agent, with its command loop, state lookups, observations and
// heartbeats, over a driver whose instances run the moment they are
// created ([agenttest.Instant]). Every instance answers at the address of
// one small forward proxy this process serves on loopback, so the health
// service's probes through each of them pass, and what the benchmark
// measures is the control plane's work alone. It is built by the
// benchmark, never shipped.
package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/service"
)

const name = "instantagent"

const about = `
Runs the agent runtime over a driver whose instances exist at once, all at
the address of one loopback forward proxy this process serves: the agent of
the end-to-end converge benchmark (e2e), not a backend.`

func main() { os.Exit(run(os.Args[1:], os.Stderr)) }

func run(args []string, stderr io.Writer) int {
	cmd := service.NewCommand(name, "[flags]", about, stderr)
	entry := cmd.Flags.String("entry", "local", "provider entry this agent serves")
	target := cmd.Flags.String("target", "instant", "target this agent serves")
	concurrency := cmd.Flags.Int("concurrency", 0, "commands handled at once (0: the runtime's default)")
	if code, ok := cmd.Parse(args); !ok {
		return code
	}
	for _, id := range []struct{ what, v string }{{"entry", *entry}, {"target", *target}} {
		if fe := events.CheckIdentifier(id.what, id.v); fe != nil {
			return cmd.Fail(2, fmt.Errorf("--%s: %w", id.what, fe))
		}
	}
	return cmd.Serve(func(ctx context.Context, base *service.Base) error {
		// The forward proxy stands in for the fleet's proxies, which run
		// on machines of their own: on the benchmark's machine it costs
		// no more than it must (no TCP keep-alive on connections that
		// carry one probe each).
		ln, err := (&net.ListenConfig{KeepAlive: -1}).Listen(ctx, "tcp", "127.0.0.1:0")
		if err != nil {
			return fmt.Errorf("forward proxy: %w", err)
		}
		proxy := &http.Server{Handler: forwardProxy{out: &http.Transport{MaxIdleConnsPerHost: 256, DialContext: noKeepAlive.DialContext}}, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = proxy.Serve(ln) }()
		defer proxy.Close()
		base.Log.Info("forward proxy serving", "addr", ln.Addr().String())
		info := agent.Info{Entry: *entry, Target: *target, Type: "instant"}
		rt, err := agent.New(base.Conn, agenttest.NewInstant(ln.Addr().String()), agent.Config{
			Info:        info,
			Concurrency: *concurrency,
			KeyDir:      agent.KeyDirOr("", cmd.Common.DataDir),
		}, base.Log, base.Tel.Tracer)
		if err != nil {
			return fmt.Errorf("agent runtime: %w", err)
		}
		return rt.Run(ctx)
	})
}

// noKeepAlive dials the forward proxy's upstream connections.
var noKeepAlive = &net.Dialer{Timeout: 10 * time.Second, KeepAlive: -1}

// forwardProxy relays plain HTTP requests in absolute form and CONNECT
// tunnels, to any destination: it listens on loopback for the benchmark's
// probes alone.
type forwardProxy struct{ out *http.Transport }

func (p forwardProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodConnect {
		p.tunnel(w, r)
		return
	}
	if !r.URL.IsAbs() {
		http.Error(w, "a proxy request names an absolute URL", http.StatusBadRequest)
		return
	}
	out := r.Clone(r.Context())
	out.RequestURI = ""
	out.Header.Del("Proxy-Connection")
	out.Header.Del("Proxy-Authorization")
	resp, err := p.out.RoundTrip(out)
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
}

func (p forwardProxy) tunnel(w http.ResponseWriter, r *http.Request) {
	up, err := noKeepAlive.DialContext(r.Context(), "tcp", r.Host)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer up.Close()
	hj, ok := w.(http.Hijacker)
	if !ok {
		http.Error(w, "cannot tunnel on this connection", http.StatusInternalServerError)
		return
	}
	down, buf, err := hj.Hijack()
	if err != nil {
		return
	}
	defer down.Close()
	if _, err := down.Write([]byte("HTTP/1.1 200 Connection established\r\n\r\n")); err != nil {
		return
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = io.Copy(up, buf) // what the client sent, buffered or not
		if tc, ok := up.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
	}()
	_, _ = io.Copy(down, up)
	_ = down.Close() // ends the copy the other way
	<-done
}
