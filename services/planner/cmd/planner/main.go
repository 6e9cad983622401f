// Command planner is proxyfleet's planner: the operator API (the
// fleet-planner micro service on fleet.api.>) and the reconciler that keeps
// every pool at its spec. Run any number of replicas; one holds the leader
// lease and reconciles. Without --nats-url it embeds the NATS server the
// other services connect to.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/embedded"
	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/replica"
	"proxyfleet/pkg/rungroup"
	"proxyfleet/pkg/service"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/planner/internal/planner"
)

const usage = `planner — proxyfleet's intent API and reconciler.

It answers the operator API as the NATS micro service "fleet-planner":

  fleet.api.pool.apply    {"name":"demo","provider":"local","size":3}
                          (optional: targets, image, profile, port, auth,
                          userData, maxAge "72h", unhealthyAfter "2m",
                          egress, gateway, autoscale)
                          {"name":"bought","provider":"external",
                           "external":{"proxies":[{"url":"http://u:p@host:3128"}]}}
                          (proxies proxyfleet does not create: listed by
                          URL, or in external.file, which the leader
                          watches; --external-allow-cidrs)
  fleet.api.pool.get      {"name":"demo"}
  fleet.api.pool.list     {}                       (a page: limit, after)
  fleet.api.pool.delete   {"name":"demo"}
  fleet.api.proxy.get     {"id":"demo-abcdefghij"}
  fleet.api.proxy.list    {"pool":"demo","limit":100,"after":"..."}
                          (every field optional; a page of the live
                          proxies in id order, at most 1000, default 500,
                          and "next", the "after" of the following page,
                          "" on the last)
  fleet.api.proxy.delete  {"id":"...","skipCleanup":false}
  fleet.api.proxy.recycle {"id":"...","now":false}
                          (replacement first; "now":true retires at once)
  fleet.api.proxy.report-ban {"id":"...","reason":"403 from example.com"}
                          (retires a banned proxy at once, reason
                          "banned: <reason>", and requests its replacement)
  fleet.api.instance.delete {"entry":"local","target":"t1","name":"px-..."}
                          (deletes a marked instance no live proxy owns,
                          such as one left by skipCleanup)

It rebuilds its state from the FLEET_EVENTS stream at start and follows it.
One replica at a time reconciles: the holder of the lease in KV
fleet-planner, which opens a leader term in the event log; the log refuses
the decisions of a replica whose term was superseded, so a leader paused
past its lease cannot decide when it resumes. It places missing proxies on
live agent targets, retires excess and failed ones, replaces proxies
unhealthy for longer than their pool's unhealthyAfter (replacement first;
the unhealthy one is retired when it is ready, or after unhealthyAfter
more), rotates proxies older than their pool's maxAge (plus a
per-proxy jitter of up to 10%; the replacement is created and ready before
the aged proxy is retired), fails and replaces proxies provisioning
longer than --provision-timeout or running longer than --ready-timeout
without one probe through them passing, re-issues stuck commands (a create issued
--max-create-attempts times without starting fails with class stuck and
goes to another target), and records each pool's conditions (Ready, Placed,
Progressing) when they change. Every --autoscale-interval it sizes the
pools with autoscale by the demand the gateways write into fleet-demand
(growing at once, shrinking after the pool's scaleDownAfter of lower
demand), each change a pool.scaled event with its reason. Every
--gc-interval it asks each live agent for its inventory: a marked instance
that no live proxy owns for longer than --gc-grace is deleted (instances of
abandoned proxies and unmarked ones are never touched), and a running proxy
whose instance is missing from its target's inventory for longer than
--gc-grace fails with class vanished and is replaced. Bad requests get a micro error
(400: unreadable, 422: not acceptable) with a JSON body naming the field.

Every replica checkpoints its state, with the event sequence it covers,
into the object store fleet-snapshots (--snapshot-events, --snapshot-interval);
a start loads the latest snapshot and replays only the events after it. A
missing, unreadable or foreign snapshot (one of another format version, or
taken from another stream) is ignored with a warning: the whole log is
replayed.

Without --nats-url the planner embeds a JetStream server listening on
--nats-listen and storing under <data-dir>/jetstream; other services connect
to it.

Usage: planner [flags]
       planner bootstrap --nats-url URL [credentials] --agent ENTRY/TARGET ...
                         (with the admin identity: create the streams,
                         buckets, object store and durable consumers the
                         services bind under deploy/nats, then exit)

`

func main() { os.Exit(run()) }

func run() int {
	if len(os.Args) > 1 && os.Args[1] == "bootstrap" {
		return bootstrap(os.Args[2:])
	}
	fs := service.NewFlagSet("planner", usage)
	common := service.Flags{Embed: embedded.Start}
	common.Register(fs, "planner")
	var cfg planner.Config
	fs.DurationVar(&cfg.ReconcileInterval, "reconcile-interval", 2*time.Second,
		"period of reconcile rounds (events also start one)")
	fs.DurationVar(&cfg.CreateTimeout, "create-timeout", 3*time.Minute,
		"a proxy requested this long without provisioning gets its create re-issued (or fails when its agent is gone)")
	fs.IntVar(&cfg.MaxCreateAttempts, "max-create-attempts", 5,
		"a create issued this many times without the proxy reaching provisioning fails it (class stuck); it is replaced on another target")
	fs.DurationVar(&cfg.QuotaAvoid, "avoid-target", 5*time.Minute,
		"a target that answered quota, or on which a create got stuck, takes no new proxy for this long")
	fs.IntVar(&cfg.StuckDeletes, "stuck-deletes", 3,
		"a retired proxy whose delete was re-issued this many times (every 3 minutes) without being deleted turns its pool's Cleanup condition False (DeleteStuck) and counts in proxyfleet_planner_deletes_stuck")
	fs.DurationVar(&cfg.CheckMaxAge, "check-max-age", 90*time.Second,
		"a target whose latest check in fleet-targets failed less than this long ago takes no new proxy (an older record, or none, does not block: health may be down)")
	fs.DurationVar(&cfg.ProvisionTimeout, "provision-timeout", 15*time.Minute,
		"a proxy provisioning this long without an address is recorded as failed (timeout) and replaced")
	fs.DurationVar(&cfg.ReadyTimeout, "ready-timeout", 15*time.Minute,
		"a proxy running this long (it has an address) without one probe through it passing is recorded as failed (timeout) and replaced; suspended while no health replica is alive, and counted afresh from its return")
	fs.DurationVar(&cfg.AutoscaleInterval, "autoscale-interval", 2*time.Second,
		"period of the leader's autoscaling rounds, which size the pools with autoscale by the gateways' demand")
	fs.DurationVar(&cfg.GCInterval, "gc-interval", time.Minute,
		"period of garbage-collection rounds (inventory requests to every live agent)")
	fs.DurationVar(&cfg.GCGrace, "gc-grace", 10*time.Minute,
		"an orphaned marked instance, or a running proxy's missing instance, must be seen so this long before it is deleted or the proxy failed (vanished)")
	fs.DurationVar(&cfg.InventoryTimeout, "inventory-timeout", 10*time.Second,
		"bound of one inventory request; a target that does not answer is skipped for the round")
	fs.IntVar(&cfg.KeepFinished, "keep-finished", 1000,
		"how many finished (deleted or abandoned) proxies stay in memory; proxy.get answers older ones from the event log (-1: none)")
	fs.IntVar(&cfg.SnapshotEvery, "snapshot-events", 50_000,
		"write a snapshot once the event log advanced this many sequences past the last one (-1: never by count)")
	fs.DurationVar(&cfg.SnapshotInterval, "snapshot-interval", 10*time.Minute,
		"write a snapshot at least this often while events arrive (-1s: never by time)")
	fs.DurationVar(&cfg.ExternalFileInterval, "external-file-interval", 5*time.Second,
		"how often the leader reads the files of external pools (external.file); a change becomes a new revision of the pool")
	allow := fs.String("external-allow-cidrs", "",
		"comma-separated ranges (CIDRs or addresses) where external pools' upstream proxies may be although the egress policy refuses them (loopback, private, ...); by default such an address is refused at apply")
	id := fs.String("id", "", "replica id in the leader lease and its terms (default <hostname>-<pid>)")
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "planner: unexpected arguments %q; see --help\n", fs.Args())
		return 2
	}
	cfg.ID = *id
	allowed, err := parseAllowCIDRs(*allow)
	if err != nil {
		fmt.Fprintf(os.Stderr, "planner: --external-allow-cidrs: %v\n", err)
		return 2
	}
	cfg.ExternalAllowCIDRs = allowed
	if cfg.ID == "" {
		cfg.ID = replica.ID("planner", replica.PID())
	}

	ctx, stop := rungroup.SignalContext()
	defer stop()
	base, err := service.Start(ctx, "planner", common)
	if err != nil {
		fmt.Fprintf(os.Stderr, "planner: %v\n", err)
		return 1
	}
	defer base.Close()
	p, err := planner.New(base.Conn, cfg, base.Log, base.Tel.Tracer, base.Tel.Meter)
	if err != nil {
		base.Log.Error("planner", "err", err)
		return 1
	}
	base.Log.Info("planner starting", "replica", cfg.ID, "nats", telemetry.RedactURL(base.Conn.ClientURL()))
	g := rungroup.Group{Log: base.Log}
	g.Go("planner", p.Run)
	if err := g.Run(ctx); err != nil {
		base.Log.Error("planner stopped", "err", err)
		return 1
	}
	base.Log.Info("planner stopped")
	return 0
}

// parseAllowCIDRs parses --external-allow-cidrs: comma-separated ranges
// or single addresses ("" is none).
func parseAllowCIDRs(s string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for v := range strings.SplitSeq(s, ",") {
		if v = strings.TrimSpace(v); v == "" {
			continue
		}
		pr, err := egress.ParseCIDR(v)
		if err != nil {
			return nil, fmt.Errorf("%q %w", v, err)
		}
		out = append(out, pr)
	}
	return out, nil
}

// agentList is the repeatable --agent flag.
type agentList []string

func (a *agentList) String() string { return strings.Join(*a, ",") }
func (a *agentList) Set(v string) error {
	if _, _, err := bus.ParseAgent(v); err != nil {
		return err
	}
	*a = append(*a, v)
	return nil
}

const bootstrapUsage = `planner bootstrap — create the NATS topology as the admin identity.

It creates or updates every stream, KV bucket and the object store, health's
durable consumer health-projection on FLEET_EVENTS, and for each --agent
ENTRY/TARGET the durable consumer agent-ENTRY-TARGET on FLEET_CMDS (filter
fleet.cmd.ENTRY.TARGET.>), then exits. Under deploy/nats only the admin
identity may do this; the services run with --ensure-topology=false and bind
what it created. Run it again after adding an agent. Safe to repeat.

Usage: planner bootstrap [flags]

`

// bootstrap is the planner's bootstrap subcommand.
func bootstrap(args []string) int {
	fs := service.NewFlagSet("planner bootstrap", bootstrapUsage)
	var common service.Flags // no Embed: bootstrap needs a server to set up
	common.Register(fs, "planner-bootstrap")
	var agents agentList
	fs.Var(&agents, "agent", "an agent's ENTRY/TARGET whose command consumer to create (repeatable), e.g. local/t1")
	var logLimits bus.RequestLogLimits
	fs.DurationVar(&logLimits.MaxAge, "request-log-max-age", 0, "set the gateways' request log (stream FLEET_GATEWAY_LOG) to drop records older than this (default 24h; kept as set when not given)")
	fs.Int64Var(&logLimits.MaxBytes, "request-log-max-bytes", 0, "set the gateways' request log to drop its oldest records past this size in bytes (default 1 GiB; kept as set when not given)")
	if code, ok := service.ParseArgs(fs, args, os.Stderr); !ok {
		return code
	}
	if err := logLimits.Check(); err != nil {
		fmt.Fprintf(os.Stderr, "planner bootstrap: %v\n", err)
		return 2
	}
	// Everything is created below, once.
	common.EnsureTopology = false
	ctx, stop := rungroup.SignalContext()
	defer stop()
	base, err := service.Start(ctx, "planner-bootstrap", common)
	if err != nil {
		fmt.Fprintf(os.Stderr, "planner bootstrap: %v\n", err)
		return 1
	}
	defer base.Close()
	bctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := bus.Bootstrap(bctx, base.Conn, agents); err != nil {
		base.Log.Error("bootstrap failed", "err", err)
		return 1
	}
	if logLimits != (bus.RequestLogLimits{}) {
		if err := bus.SetRequestLogLimits(bctx, base.Conn, logLimits); err != nil {
			base.Log.Error("bootstrap failed", "err", err)
			return 1
		}
	}
	base.Log.Info("topology ready", "agents", agents.String(), "replicas", base.Conn.Replicas())
	return 0
}
