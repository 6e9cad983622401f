// Command local-agent is the proxyfleet agent of the local backend: it runs
// each proxy as its own process on this machine (the built-in forward proxy,
// or Squid with --squid) and executes the planner's commands for its entry
// and target. "local-agent proxy" runs one built-in proxy in the foreground;
// the agent starts it that way.
package main

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/service"
	"proxyfleet/services/local-agent/internal/local"
)

const name = "local-agent"

const about = `
Runs the proxyfleet agent of the local backend: every proxy is a process on
this machine, started in its own session so it outlives the agent, and found
again from the state directory when the agent restarts.`

func main() { os.Exit(run(os.Args[1:], os.Stderr)) }

func run(args []string, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "proxy" {
		return runProxy(args[1:], stderr)
	}
	cmd := service.NewCommand(name, "[flags]\n       "+name+" proxy --listen HOST:PORT [--auth-file FILE] [--source-addr IP]", about, stderr)
	fs := cmd.Flags
	entry := fs.String("entry", "local", "provider entry this agent serves; commands arrive on fleet.cmd.<entry>.<target>.*")
	target := fs.String("target", defaultTarget(), "target name of this machine; the default is the hostname made a valid identifier")
	ports := fs.String("ports", "20000-20999", "port range FIRST-LAST that proxies listen on, one port per proxy; 0 has the kernel choose each port (built-in proxy; needs --capacity)")
	bind := fs.String("bind", "127.0.0.1", "address proxies listen on; it is also the host of each proxy's published address")
	sources := fs.String("source-addrs", "", "comma-separated source addresses for outgoing connections; each proxy gets one, the least used first (empty: the system's choice)")
	stateDir := fs.String("state-dir", "", "state directory: one <instance>.json per proxy, the marker that finds proxies again after a restart (default <data-dir>/proxies)")
	squid := fs.String("squid", "", "path of the squid binary (e.g. /usr/sbin/squid) to run each proxy as Squid; empty runs the built-in proxy")
	capacity := fs.Int("capacity", 0, "maximum number of proxies on this machine; 0 means the size of the port range (required with --ports 0)")
	recheck := agent.RecheckFlag(fs)
	endpoints := agent.EgressFlag(fs)
	keyDir := agent.KeyDirFlag(fs)
	labels := agent.LabelsFlag(fs)
	if code, ok := cmd.Parse(args); !ok {
		return code
	}
	cfg := local.Config{Entry: *entry, Target: *target, Bind: *bind, StateDir: *stateDir, Squid: *squid, Capacity: *capacity}
	if cfg.StateDir == "" {
		cfg.StateDir = filepath.Join(cmd.Common.DataDir, "proxies")
	}
	for _, a := range strings.Split(*sources, ",") {
		if a = strings.TrimSpace(a); a != "" {
			cfg.SourceAddrs = append(cfg.SourceAddrs, a)
		}
	}
	var problems []error
	if fe := events.CheckIdentifier("entry", *entry); fe != nil {
		problems = append(problems, fmt.Errorf("--entry: %w", fe))
	} else if *entry == events.ProviderExternal {
		problems = append(problems, fmt.Errorf("--entry: %q is reserved for external pools, whose proxies no agent serves; name the entry otherwise", *entry))
	}
	if fe := events.CheckIdentifier("target", *target); fe != nil {
		problems = append(problems, fmt.Errorf("--target: %w", fe))
	}
	pr, err := local.ParsePortRange(*ports)
	if err != nil {
		problems = append(problems, fmt.Errorf("--ports: %w", err))
		pr = local.PortRange{First: 1, Last: 1} // reported; let the other checks run
	}
	cfg.Ports = pr
	exe, err := os.Executable()
	if err != nil {
		problems = append(problems, fmt.Errorf("cannot find my own executable: %w", err))
	}
	cfg.Executable = exe
	problems = append(problems, cfg.Problems()...)
	if len(problems) > 0 {
		for _, p := range problems {
			cmd.Printf("%v", p)
		}
		cmd.Printf("see --help")
		return 2
	}
	// Before NATS: a second agent on this state directory starts nothing.
	lock, err := local.LockStateDir(cfg.StateDir)
	if err != nil {
		return cmd.Fail(1, err)
	}
	defer lock.Release()
	return cmd.Serve(func(ctx context.Context, base *service.Base) error {
		return serve(ctx, base, cfg, *labels, *recheck, *endpoints, agent.KeyDirOr(*keyDir, cmd.Common.DataDir))
	})
}

// serve runs the local driver and its agent runtime until ctx ends; the
// target announces labels.
func serve(ctx context.Context, base *service.Base, cfg local.Config, labels map[string]string, recheck time.Duration, endpoints []netip.AddrPort, keyDir string) error {
	drv, err := local.New(cfg, base.Log.With("component", "local"))
	if err != nil {
		return fmt.Errorf("local driver: %w", err)
	}
	info := agent.Info{Entry: cfg.Entry, Target: cfg.Target, Type: "local", Capacity: cfg.EffectiveCapacity(), Labels: labels}
	rt, err := agent.New(base.Conn, drv, agent.Config{Info: info, RecheckInterval: recheck, EgressEndpoints: endpoints, KeyDir: keyDir}, base.Log, base.Tel.Tracer)
	if err != nil {
		return fmt.Errorf("agent runtime: %w", err)
	}
	base.Log.Info("local backend", "state_dir", cfg.StateDir, "ports", cfg.Ports.String(), "bind", cfg.Bind, "squid", cfg.Squid)
	return rt.Run(ctx)
}

// defaultTarget is the hostname made a valid identifier, or "local".
func defaultTarget() string {
	h, err := os.Hostname()
	if err != nil {
		return "local"
	}
	return sanitize(h)
}

// sanitize lowercases s, turns every character outside [a-z0-9-] into '-',
// and trims it to the identifier rule; it returns "local" when nothing
// usable is left.
func sanitize(s string) string {
	b := []byte(strings.ToLower(s))
	for i, c := range b {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			b[i] = '-'
		}
	}
	out := string(b)
	if len(out) > 63 {
		out = out[:63]
	}
	out = strings.Trim(out, "-")
	if !events.IsIdentifier(out) {
		return "local"
	}
	return out
}
