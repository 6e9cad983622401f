// Command gateway is proxyfleet's crawler gateway: one forward-proxy
// endpoint (plain HTTP and CONNECT) in front of the fleet. A client names
// a pool, and optionally a sticky session, in its Proxy-Authorization
// username; the gateway relays each connection through a ready proxy of
// that pool with the pool's credentials, retries failed attempts on other
// proxies, reports bans found by the pool's rules, and writes the demand
// the planner sizes autoscaled pools by (docs/gateway.md).
package main

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"proxyfleet/pkg/buildinfo"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/replica"
	"proxyfleet/pkg/rungroup"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/service"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/gateway/internal/clients"
	"proxyfleet/services/gateway/internal/cooldown"
	"proxyfleet/services/gateway/internal/fleet"
	"proxyfleet/services/gateway/internal/forward"
	"proxyfleet/services/gateway/internal/gctarget"
	"proxyfleet/services/gateway/internal/reqlog"
	"proxyfleet/services/gateway/internal/route"
)

const usage = `gateway is the crawler's one endpoint in front of the proxyfleet fleet: an
HTTP forward proxy (plain HTTP and CONNECT) that routes each connection to a
ready proxy of the pool the client names.

  curl -x http://<pool>:<password>@127.0.0.1:8888 http://example.com/
  curl -x http://<pool>.session-<id>:<password>@127.0.0.1:8888 ...   (sticky)

Clients authenticate with --clients-file (htpasswd -B lines "<pool>:<hash>",
or "*:<hash>" for every pool). Without it the gateway accepts any password,
and only on a loopback --listen.

Usage:
  gateway --nats-url nats://127.0.0.1:4222 [flags]

Flags:
`

type flags struct {
	base            service.Flags
	listen          string
	clientsFile     string
	name            string
	keyFile         string
	dialTimeout     time.Duration
	responseTimeout time.Duration
	demandInterval  time.Duration
	syncTimeout     time.Duration
	cooldown        time.Duration

	sessionsPerPool   int
	sessionsPerClient int
	bodyTimeout       time.Duration
	tunnelIdle        time.Duration
	connsPerClient    int
	loginFailures     int
	loginFailureEvery time.Duration
	loginCache        int

	caOut            string
	originCA         string
	originRoots      *x509.CertPool
	requestLogSample float64
	requestLogQuery  bool
}

func parse(args []string) (*flags, error) {
	f := flags{}
	fs := service.NewFlagSet("gateway", usage)
	f.base.Register(fs, "gateway")
	fs.StringVar(&f.listen, "listen", "127.0.0.1:8888", "client address of the forward proxy; port 0 picks a free port (logged)")
	fs.StringVar(&f.clientsFile, "clients-file", "", "htpasswd file of client passwords (bcrypt, htpasswd -B): user <pool> or * ; re-read when it changes; required unless --listen is loopback")
	fs.StringVar(&f.name, "name", "", "this gateway's name among gateways (its fleet-demand keys <pool>.<name>, its subjects fleet.gateway.<name>.info|stats): letters, digits, '-', '_' (default <hostname>-<listen port>)")
	fs.StringVar(&f.keyFile, "key-file", "", "file holding the gateway's curve (xkey) seed, created 0600 on first start; the planner seals each pool's proxy password to its key; give every gateway the same file (default <data-dir>/gateway.xk)")
	fs.DurationVar(&f.dialTimeout, "dial-timeout", 5*time.Second, "bound of the connection to a proxy (and of its answer to CONNECT) before the attempt fails over")
	fs.DurationVar(&f.responseTimeout, "response-timeout", 60*time.Second, "bound of the wait for a proxy's response headers to a plain HTTP request")
	fs.DurationVar(&f.demandInterval, "demand-interval", 2*time.Second, "how often each pool's demand is written to fleet-demand (at most 10s: the bucket keeps a report 15s)")
	fs.DurationVar(&f.cooldown, "cooldown", 10*time.Second, "how long new connections avoid a proxy that failed one (it is reported to health, which probes it at once, once per cooldown); all cooling proxies are used when no other is left")
	fs.DurationVar(&f.syncTimeout, "sync-timeout", 30*time.Second, "how long to wait for the fleet's views before accepting clients anyway")
	fs.IntVar(&f.sessionsPerPool, "max-sessions-per-pool", route.DefaultSessionsPerPool, "sessions a pool keeps at most; a new one past it replaces the pool's least recently used")
	fs.IntVar(&f.sessionsPerClient, "max-sessions-per-client", route.DefaultSessionsPerClient, "sessions one client address keeps in a pool at most; a new one past it replaces that client's least recently used")
	fs.DurationVar(&f.bodyTimeout, "body-timeout", 30*time.Second, "how long a request body may go without a byte arriving before the request is answered 408 and the connection closed")
	fs.DurationVar(&f.tunnelIdle, "tunnel-idle-timeout", 2*time.Minute, "a CONNECT tunnel that carries nothing either way for this long is closed")
	fs.IntVar(&f.connsPerClient, "max-conns-per-client", 512, "connections (tunnels included) one client address may hold open; one more is answered 429 and closed")
	fs.IntVar(&f.loginFailures, "login-failures", clients.DefaultFailureBurst, "failed logins one client address may make in a row before it is throttled (429 with Retry-After); with --clients-file")
	fs.DurationVar(&f.loginFailureEvery, "login-failure-every", clients.DefaultFailureEvery, "how often a throttled client address gets one more try")
	fs.IntVar(&f.loginCache, "login-cache", clients.DefaultCacheSize, "login verdicts (right and wrong) remembered for 5 minutes, so a repeated password costs no bcrypt; keyed by a keyed hash, never the password")
	fs.StringVar(&f.caOut, "ca-out", "", "file to write the gateway CA's certificate (PEM, mode 0644) to once it is loaded: what clients of pools with gateway.intercept trust (curl --cacert FILE)")
	fs.StringVar(&f.originCA, "origin-ca", "", "PEM bundle of CA certificates that origins' certificates are verified against besides the system's roots (https:// requests, intercepted ones included)")
	fs.Float64Var(&f.requestLogSample, "request-log-sample", 1, "share (0..1) of plain successful requests recorded in the request log (stream FLEET_GATEWAY_LOG, subject fleet.gateway.log.<name>); errors, bans and failed-over requests are always recorded; 0 turns the log off")
	fs.BoolVar(&f.requestLogQuery, "request-log-query", false, "keep the query string in the request log's paths (it may carry tokens; off by default)")
	if err := service.ParseFlags(fs, args); err != nil {
		return nil, err
	}
	if f.demandInterval <= 0 || f.demandInterval > 10*time.Second {
		return nil, fmt.Errorf("--demand-interval %s: want more than 0 and at most 10s", f.demandInterval)
	}
	if f.requestLogSample < 0 || f.requestLogSample > 1 {
		return nil, fmt.Errorf("--request-log-sample %v: want a share from 0 (off) to 1 (every request)", f.requestLogSample)
	}
	if f.dialTimeout <= 0 || f.responseTimeout <= 0 || f.cooldown <= 0 {
		return nil, errors.New("--dial-timeout, --response-timeout and --cooldown must be more than 0")
	}
	for _, c := range []struct {
		name string
		ok   bool
	}{
		{"--max-sessions-per-pool", f.sessionsPerPool > 0},
		{"--max-sessions-per-client", f.sessionsPerClient > 0},
		{"--body-timeout", f.bodyTimeout > 0},
		{"--tunnel-idle-timeout", f.tunnelIdle > 0},
		{"--max-conns-per-client", f.connsPerClient > 0},
		{"--login-failures", f.loginFailures > 0},
		{"--login-failure-every", f.loginFailureEvery > 0},
		{"--login-cache", f.loginCache > 0},
	} {
		if !c.ok {
			return nil, fmt.Errorf("%s must be more than 0", c.name)
		}
	}
	loopback, err := bus.ListenIsLoopback(f.listen)
	if err != nil {
		return nil, fmt.Errorf("--listen: %w", err)
	}
	if !loopback && f.clientsFile == "" {
		return nil, fmt.Errorf("--listen %s is not loopback: give --clients-file, or every host that reaches it could use the fleet", f.listen)
	}
	if f.name != "" {
		if err := fleet.CheckName(f.name); err != nil {
			return nil, fmt.Errorf("--name: %w", err)
		}
	}
	if f.originRoots, err = forward.OriginRoots(f.originCA); err != nil {
		return nil, fmt.Errorf("--origin-ca: %w", err)
	}
	return &f, nil
}

func main() { os.Exit(service.Main("gateway", os.Args[1:], os.Stderr, parse, run)) }

func run(f *flags) error {
	gctarget.Apply()
	auth := func(string, string, string) (bool, error) { return true, nil }
	if f.clientsFile != "" {
		file, err := clients.Load(f.clientsFile, clients.Limits{
			FailureBurst: f.loginFailures, FailureEvery: f.loginFailureEvery, CacheSize: f.loginCache,
		})
		if err != nil {
			return err
		}
		auth = file.Allow
	}
	keyFile := f.keyFile
	if keyFile == "" {
		keyFile = filepath.Join(f.base.DataDir, "gateway.xk")
	}
	if err := os.MkdirAll(filepath.Dir(keyFile), 0o700); err != nil {
		return fmt.Errorf("key file: %w", err)
	}
	key, err := seal.LoadOrCreate(keyFile)
	if err != nil {
		return fmt.Errorf("gateway key: %w", err)
	}
	ln, err := net.Listen("tcp", f.listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	defer func() { _ = ln.Close() }()
	addr := ln.Addr().String()
	ln = forward.LimitListener(ln, f.connsPerClient)
	if f.name == "" {
		_, port, _ := net.SplitHostPort(addr)
		f.name = replica.ID("gateway", port)
	}

	ctx, stop := rungroup.SignalContext()
	defer stop()
	base, err := service.Start(ctx, "gateway", f.base)
	if err != nil {
		return err
	}
	defer base.Close()
	log := base.Log

	metrics, err := forward.NewMetrics(base.Tel.Meter)
	if err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	table := route.NewTable(route.Limits{SessionsPerPool: f.sessionsPerPool, SessionsPerClient: f.sessionsPerClient}, nil)
	cooldowns := cooldown.NewSet(events.MaxRetireAfterSitesWindow, nil)
	view, err := fleet.New(base.Conn, table, fleet.Config{
		Name: f.name, Key: key, DemandInterval: f.demandInterval, Listen: addr, Version: buildinfo.Version, CAOut: f.caOut,
		Cooldowns: cooldowns,
	}, log)
	if err != nil {
		return err
	}
	requests, err := reqlog.New(base.Conn.NC, reqlog.Config{Gateway: f.name, Sample: f.requestLogSample, KeepQuery: f.requestLogQuery, Log: log})
	if err != nil {
		return fmt.Errorf("request log: %w", err)
	}
	if err := requests.RegisterMetrics(base.Tel.Meter); err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	srv := forward.New(forward.Config{
		Table: table, Fleet: view, Auth: auth, Log: log, Metrics: metrics,
		DialTimeout: f.dialTimeout, ResponseTimeout: f.responseTimeout, Cooldown: f.cooldown,
		BodyTimeout: f.bodyTimeout, TunnelIdleTimeout: f.tunnelIdle,
		Cooldowns: cooldowns,
		CA:        view, OriginRoots: f.originRoots,
		RequestLog: requests,
	})
	defer srv.Close()

	// The fleet's views are added first: the forward proxy routes by them,
	// so it stops (refusing new clients, finishing requests in flight)
	// before they do.
	g := rungroup.Group{Log: log}
	g.Go("fleet", func(ctx context.Context) error { return view.Run(ctx, srv) })
	// Added before the server: it stops after it, publishing the last
	// requests' records.
	g.Go("request-log", requests.Run)
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute, ErrorLog: nil}
	serve := rungroup.HTTP("serve", hs, ln, 5*time.Second)
	serveHTTP := serve.Run
	serve.Run = func(ctx context.Context) error {
		select {
		case <-view.Synced():
		case <-time.After(f.syncTimeout):
			log.Warn("the fleet's views did not load in time; accepting clients anyway", "after", f.syncTimeout.String())
		case <-ctx.Done():
			return nil
		}
		var lim syscall.Rlimit
		if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim) == nil {
			// A tunnel holds 6 descriptors: the two sockets and a splice pipe
			// each way (docs/performance.md#gateway).
			log.Info("open-file limit", "limit", lim.Cur, "tunnels_at_most", lim.Cur/6)
		}
		authMode := "clients file " + f.clientsFile
		if f.clientsFile == "" {
			authMode = "any password (loopback only; give --clients-file to check them)"
		}
		log.Info("gateway serving", "listen", addr, "name", f.name, "auth", authMode,
			"info", events.GatewaySubject(f.name, events.GatewayInfo), "stats", events.GatewaySubject(f.name, events.GatewayStats),
			"ca", events.GatewaySubject(f.name, events.GatewayCA),
			"nats", telemetry.RedactURL(base.Conn.ClientURL()))
		return serveHTTP(ctx)
	}
	g.Add(serve)
	if err := g.Run(ctx); err != nil {
		return err
	}
	log.Info("gateway stopped")
	return nil
}
