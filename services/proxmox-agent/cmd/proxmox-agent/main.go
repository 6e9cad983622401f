// Command proxmox-agent is the proxyfleet agent of one Proxmox VE cluster:
// every configured node is a target, served by its own agent runtime in this
// one process, and every proxy is a clone of a template VM booted with a
// NoCloud seed ISO.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/service"
	"proxyfleet/services/proxmox-agent/internal/config"
	"proxyfleet/services/proxmox-agent/internal/proxmox"
	"proxyfleet/services/proxmox-agent/internal/pve"
)

const name = "proxmox-agent"

// version is set at build time with -ldflags "-X main.version=…".
var version = "dev"

func main() { os.Exit(run(os.Args[1:], os.Stderr)) }

func run(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	var common service.Flags
	common.Register(fs, name)
	cfgPath := fs.String("config", "/etc/proxyfleet/proxmox-agent.yaml",
		"configuration file (YAML): entry, API URL, token file, TLS pin or CA, nodes, templates, seeds storage, bridge, VLAN, profiles")
	check := fs.Bool("check-config", false, "validate the configuration file and exit")
	recheck := agent.RecheckFlag(fs)
	fs.Usage = func() {
		fmt.Fprintf(stderr, `Usage: %s [flags]

Runs the proxyfleet agent of one Proxmox VE cluster. Each node listed in the
configuration is a target with its own command consumer
(fleet.cmd.<entry>.<node>.*), heartbeat in fleet-agents and request
endpoints (fleet.agent.<entry>.<node>.{info,inventory,check}). Every proxy
is a linked (or full) clone of a template VM with a NoCloud seed ISO on
ide2; VMIDs are reserved in the fleet-vmids bucket before cloning.
See docs/proxmox.md for the configuration reference.

Flags:
`, name)
		fs.PrintDefaults()
	}
	if code, ok := service.ParseArgs(fs, args, stderr); !ok {
		return code
	}
	cfg, err := config.Load(*cfgPath)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return 2
	}
	clientCfg := pve.Config{URL: cfg.APIURL, TokenFile: cfg.TokenFile, CAFile: cfg.CAFile,
		Fingerprint: cfg.Fingerprint, TaskPollInterval: time.Duration(cfg.TaskPollInterval), RequestTimeout: time.Duration(cfg.RequestTimeout)}
	if _, err := pve.New(clientCfg); err != nil {
		fmt.Fprintf(stderr, "%s: %s: %v\n", name, *cfgPath, err)
		return 2
	}
	if *check {
		fmt.Fprintf(stderr, "%s: %s is valid\n", name, *cfgPath)
		return 0
	}

	ctx, stop := service.SignalContext()
	defer stop()
	base, err := service.Start(ctx, name, common)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return 1
	}
	defer base.Close()
	clientCfg.Log, clientCfg.Tracer = base.Log.With("component", "pve"), base.Tel.Tracer
	client, err := pve.New(clientCfg)
	if err != nil {
		base.Log.Error("Proxmox VE client", "err", err)
		return 1
	}
	kv, err := base.Conn.JS.KeyValue(ctx, bus.BucketVMIDs)
	if err != nil {
		base.Log.Error("VMID bucket", "bucket", bus.BucketVMIDs, "err", err)
		return 1
	}
	return runNodes(ctx, base, cfg, client, kv, *recheck)
}

// runNodes runs one agent runtime per configured node until ctx ends.
func runNodes(ctx context.Context, base *service.Base, cfg *config.Config, client *pve.Client, kv jetstream.KeyValue, recheck time.Duration) int {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	failed := make(chan struct{}, len(cfg.Nodes))
	for _, node := range cfg.Nodes {
		drv, err := proxmox.New(proxmox.Options{Config: cfg, Node: node, Client: client, VMIDs: kv, Log: base.Log})
		if err != nil {
			base.Log.Error("driver", "node", node, "err", err)
			return 1
		}
		rt, err := agent.New(base.Conn, drv, agent.Config{Info: agent.Info{
			Entry: cfg.Entry, Target: node, Type: "proxmox", Images: cfg.ImageKeys(), Profiles: cfg.ProfileNames(),
			Capacity: cfg.Capacity, Version: version,
		}, RecheckInterval: recheck}, base.Log, base.Tel.Tracer)
		if err != nil {
			base.Log.Error("agent runtime", "node", node, "err", err)
			return 1
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := rt.Run(ctx); err != nil {
				base.Log.Error("agent stopped", "node", node, "err", err)
				failed <- struct{}{}
				cancel()
			}
		}()
	}
	wg.Wait()
	if len(failed) > 0 {
		return 1
	}
	return 0
}
