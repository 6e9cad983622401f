// Command health is proxyfleet's health service: it projects FLEET_EVENTS
// into the fleet-proxies and fleet-pools views, probes every proxy through
// itself against an echo endpoint (which it also serves), appends ready and
// unhealthy events on transitions, and polls agents' checks into
// fleet-targets.
package main

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"proxyfleet/pkg/bus/embedded"
	"proxyfleet/pkg/replica"
	"proxyfleet/pkg/rungroup"
	"proxyfleet/pkg/seal"
	"proxyfleet/pkg/service"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/health/internal/compact"
	"proxyfleet/services/health/internal/echo"
	"proxyfleet/services/health/internal/probe"
	"proxyfleet/services/health/internal/projection"
	"proxyfleet/services/health/internal/targets"
)

const usage = `health projects the proxyfleet event log into KV views, probes every proxy
through itself and reports ready/unhealthy transitions.

  fleet-proxies  one key per proxy: pool, state, address, …   (rebuildable)
  fleet-pools    one key per pool: spec and revision          (rebuildable)
  fleet-probes   probe counters: latency, failure streak, egress IP, shared egress
  fleet-targets  each live agent's check verdicts

Deleted keys leave markers in these buckets, which every replica purges
once they are older than --compact-after (docs/operator-guide.md).

Usage:
  health [flags]
  health --nats-url nats://127.0.0.1:4222 --data-dir .run/health
  health --rebuild-views    drop the two views and the projection consumer, replay
                            the whole log into them, and exit (stop the running
                            health service first; start it again afterwards)

Flags:
`

type flags struct {
	base           service.Flags
	probeInterval  time.Duration
	probeTimeout   time.Duration
	probeConc      int
	unhealthyAfter int
	echoAddr       string
	echoURL        string
	checkInterval  time.Duration
	checkTimeout   time.Duration
	rebuild        bool
	probeKeyFile   string
	replicaID      string
	compactEvery   time.Duration
	compactAfter   time.Duration
}

func parse(args []string) (*flags, error) {
	f := flags{base: service.Flags{Embed: embedded.Start}}
	fs := service.NewFlagSet("health", usage)
	f.base.Register(fs, "health")
	fs.DurationVar(&f.probeInterval, "probe-interval", 5*time.Second, "time from the end of one probe of a proxy to the start of the next (jittered by ±20%)")
	fs.DurationVar(&f.probeTimeout, "probe-timeout", 3*time.Second, "bound of each check of a probe (plain HTTP, CONNECT)")
	fs.IntVar(&f.probeConc, "probe-concurrency", 0, "probes in flight at most; 0 sizes it for the fleet: 2 × proxies × mean probe time ÷ (interval + mean probe time), within 32…1024")
	fs.IntVar(&f.unhealthyAfter, "unhealthy-after", 3, "consecutive failed probes that make a ready proxy unhealthy (one never ready stays running; the planner's --ready-timeout replaces it)")
	fs.StringVar(&f.echoAddr, "echo-addr", "127.0.0.1:8480", "serve the egress echo endpoint (GET / → {\"ip\":…}) here; empty disables it")
	fs.StringVar(&f.echoURL, "echo-url", "", "echo URL the probes fetch through each proxy; answers JSON with \"ip\" or a plain-text IP (default: http://<echo-addr>/)")
	fs.DurationVar(&f.checkInterval, "check-interval", 30*time.Second, "time between two rounds of agent checks")
	fs.DurationVar(&f.checkTimeout, "check-timeout", 10*time.Second, "how long one agent may take to answer its check")
	fs.StringVar(&f.probeKeyFile, "probe-key-file", "", "file holding health's curve (xkey) seed, created 0600 on first start; the planner seals each pool's probe password to its key; give every replica the same file (default <data-dir>/probe.xk)")
	fs.StringVar(&f.replicaID, "replica-id", replica.ID("health", replica.PID()), "name of this health replica among those splitting the probing (its key in fleet-health): letters, digits, '-', '_', '=', inner dots; unique per replica")
	fs.DurationVar(&f.compactEvery, "compact-every", time.Hour, "time between two purges of the old delete markers of fleet-proxies, fleet-pools, fleet-probes and fleet-targets (the first at a random time within it); 0 never purges them")
	fs.DurationVar(&f.compactAfter, "compact-after", 24*time.Hour, "age of the delete markers a purge removes, at least 1h: a watcher (gateway, console) cut off from NATS for longer while it kept running could miss a deletion")
	fs.BoolVar(&f.rebuild, "rebuild-views", false, "drop fleet-proxies, fleet-pools and the projection consumer, replay FLEET_EVENTS into them, and exit")
	if err := service.ParseFlags(fs, args); err != nil {
		return nil, err
	}
	if f.probeConc < 0 {
		return nil, fmt.Errorf("--probe-concurrency %d: want 0 (sized for the fleet) or more", f.probeConc)
	}
	if err := probe.CheckReplica(f.replicaID); err != nil {
		return nil, fmt.Errorf("--replica-id: %w", err)
	}
	if f.compactEvery < 0 {
		return nil, fmt.Errorf("--compact-every %s: want 0 (never) or a positive duration", f.compactEvery)
	}
	if f.compactAfter < time.Hour {
		return nil, fmt.Errorf("--compact-after %s: want at least 1h, so that no watcher misses a deletion", f.compactAfter)
	}
	if f.echoAddr == "" && f.echoURL == "" {
		return nil, errors.New("--echo-url is required when --echo-addr is empty")
	}
	return &f, nil
}

func main() { os.Exit(service.Main("health", os.Args[1:], os.Stderr, parse, run)) }

func run(f *flags) error {
	ctx, stop := rungroup.SignalContext()
	defer stop()
	base, err := service.Start(ctx, "health", f.base)
	if err != nil {
		return err
	}
	defer base.Close()
	log := base.Log

	if f.rebuild {
		log.Info("dropping the views and replaying the event log into them")
		if err := projection.Replay(ctx, base.Conn, log); err != nil {
			return fmt.Errorf("rebuild views: %w", err)
		}
		log.Info("views rebuilt")
		return nil
	}

	// The echo endpoint is added first: the probes fetch it through every
	// proxy, so it stops after them.
	g := rungroup.Group{Log: log}
	echoURL := f.echoURL
	if f.echoAddr != "" {
		// A probe's connection carries one request and closes: TCP
		// keep-alive would only cost three system calls per accept.
		ln, err := (&net.ListenConfig{KeepAlive: -1}).Listen(ctx, "tcp", f.echoAddr)
		if err != nil {
			return fmt.Errorf("echo endpoint: %w", err)
		}
		if echoURL == "" {
			echoURL = echo.URL(ln.Addr().String())
		}
		g.Add(rungroup.HTTP("echo", &http.Server{Handler: echo.Handler(), ReadHeaderTimeout: 5 * time.Second}, ln, 5*time.Second))
		log.Info("echo endpoint serving", "addr", ln.Addr().String())
	}

	keyFile := f.probeKeyFile
	if keyFile == "" {
		keyFile = filepath.Join(f.base.DataDir, "probe.xk")
	}
	key, err := seal.LoadOrCreate(keyFile)
	if err != nil {
		return fmt.Errorf("probe key: %w", err)
	}
	projector := projection.New(base.Conn, log, base.Tel)
	prober, err := probe.New(base.Conn, probe.Config{
		EchoURL: echoURL, Interval: f.probeInterval, Timeout: f.probeTimeout,
		Concurrency: f.probeConc, UnhealthyAfter: f.unhealthyAfter, Key: key,
		Replica: f.replicaID, Behind: projector.Behind,
	}, log, base.Tel)
	if err != nil {
		return err
	}
	checker := targets.New(base.Conn, targets.Config{Interval: f.checkInterval, Timeout: f.checkTimeout}, log)
	g.Add(rungroup.Member{Name: "projection", Run: projector.Run}, rungroup.Member{Name: "probe", Run: prober.Run}, rungroup.Member{Name: "targets", Run: checker.Run})
	if f.compactEvery > 0 {
		compactor := compact.New(base.Conn, compact.Config{Every: f.compactEvery, After: f.compactAfter}, log)
		g.Add(rungroup.Member{Name: "compact", Run: compactor.Run})
	}
	log.Info("health started", "replica", f.replicaID, "echo_url", echoURL, "probe_interval", f.probeInterval.String(), "nats", telemetry.RedactURL(base.Conn.ClientURL()))
	if err := g.Run(ctx); err != nil {
		return err
	}
	log.Info("health stopped")
	return nil
}
