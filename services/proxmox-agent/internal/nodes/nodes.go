// Package nodes serves every node of one Proxmox VE cluster from one
// process: each configured node is a target with its own driver and agent
// runtime, all sharing one API client and the fleet-vmids bucket.
package nodes

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/services/proxmox-agent/internal/config"
	"proxyfleet/services/proxmox-agent/internal/proxmox"
	"proxyfleet/services/proxmox-agent/internal/pve"
)

// Options are what [Run] serves and with what.
type Options struct {
	Config *config.Config
	// RecheckInterval is every runtime's [agent.Config.RecheckInterval].
	RecheckInterval time.Duration
	// EgressEndpoints is every runtime's [agent.Config.EgressEndpoints].
	EgressEndpoints []netip.AddrPort
	// KeyDir holds the agents' curve key files (agent.Config.KeyDir).
	KeyDir string
	// Log and Tracer may be nil (discard, no tracing).
	Log    *slog.Logger
	Tracer trace.Tracer
}

// Run serves every configured node until ctx ends, or until one runtime
// fails, which stops them all (see [agent.RunAll]).
func Run(ctx context.Context, conn *bus.Conn, o Options) error {
	runners, err := Runtimes(ctx, conn, o)
	if err != nil {
		return err
	}
	return agent.RunAll(ctx, runners...)
}

// Runtimes builds the API client and one agent runtime per configured node,
// without starting them.
func Runtimes(ctx context.Context, conn *bus.Conn, o Options) ([]agent.Runner, error) {
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	cfg := o.Config
	clientCfg := cfg.ClientConfig()
	clientCfg.Log, clientCfg.Tracer = log.With("component", "pve"), o.Tracer
	client, err := pve.New(clientCfg)
	if err != nil {
		return nil, fmt.Errorf("API client: %w", err)
	}
	kv, err := conn.JS.KeyValue(ctx, bus.BucketVMIDs)
	if err != nil {
		return nil, fmt.Errorf("VMID bucket %s: %w", bus.BucketVMIDs, err)
	}
	runners := make([]agent.Runner, 0, len(cfg.Nodes))
	for _, node := range cfg.Nodes {
		drv, err := proxmox.New(proxmox.Options{Config: cfg, Node: node, Client: client, VMIDs: kv, Log: log})
		if err != nil {
			return nil, fmt.Errorf("node %s: %w", node, err)
		}
		info := agent.Info{Entry: cfg.Entry, Target: node, Type: "proxmox", Images: cfg.ImageKeys(),
			Profiles: cfg.ProfileNames(), Capacity: cfg.Capacity, Labels: cfg.LabelsOf(node)}
		rt, err := agent.New(conn, drv, agent.Config{Info: info, RecheckInterval: o.RecheckInterval, EgressEndpoints: o.EgressEndpoints, KeyDir: o.KeyDir}, log, o.Tracer)
		if err != nil {
			return nil, fmt.Errorf("node %s: agent runtime: %w", node, err)
		}
		runners = append(runners, rt)
	}
	return runners, nil
}
