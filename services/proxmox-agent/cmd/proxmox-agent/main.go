// Command proxmox-agent is the proxyfleet agent of one Proxmox VE cluster:
// every configured node is a target, served by its own agent runtime in this
// one process, and every proxy is a clone of a template VM booted with a
// NoCloud seed ISO.
package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agentconfig"
	"proxyfleet/pkg/service"
	"proxyfleet/services/proxmox-agent/internal/config"
	"proxyfleet/services/proxmox-agent/internal/nodes"
	"proxyfleet/services/proxmox-agent/internal/pve"
)

const name = "proxmox-agent"

// version is set at build time with -ldflags "-X main.version=…".
var version = "dev"

const about = `
Runs the proxyfleet agent of one Proxmox VE cluster. Each node listed in the
configuration is a target with its own command consumer
(fleet.cmd.<entry>.<node>.*), heartbeat in fleet-agents and request
endpoints (fleet.agent.<entry>.<node>.{info,inventory,check}). Every proxy
is a linked (or full) clone of a template VM with a NoCloud seed ISO on
ide2; VMIDs are reserved in the fleet-vmids bucket before cloning.
See docs/proxmox.md for the configuration reference.`

func main() { os.Exit(run(os.Args[1:], os.Stderr)) }

func run(args []string, stderr io.Writer) int {
	cmd := service.NewCommand(name, "[flags]", about, stderr)
	var cf agentconfig.Flags
	cf.Register(cmd.Flags, "/etc/proxyfleet/proxmox-agent.yaml",
		"entry, API URL, token file, TLS pin or CA, nodes, templates, seeds storage, bridge, VLAN, profiles")
	recheck := agent.RecheckFlag(cmd.Flags)
	if code, ok := cmd.Parse(args); !ok {
		return code
	}
	cfg, err := config.Load(cf.Path)
	if err != nil {
		return cmd.Fail(2, err)
	}
	// The token file and the TLS pin or CA are checked with the rest.
	if _, err := pve.New(cfg.ClientConfig()); err != nil {
		return cmd.Fail(2, fmt.Errorf("%s: %w", cf.Path, err))
	}
	if cf.Check {
		cmd.Printf("%s is valid", cf.Path)
		return 0
	}
	return cmd.Serve(func(ctx context.Context, base *service.Base) error {
		return nodes.Run(ctx, base.Conn, nodes.Options{Config: cfg, RecheckInterval: *recheck, Version: version,
			Log: base.Log, Tracer: base.Tel.Tracer})
	})
}
