// Command proxmox-agent is the proxyfleet agent of one Proxmox VE cluster:
// every configured node is a target, served by its own agent runtime in this
// one process, and every proxy is a clone of a template VM booted with a
// NoCloud seed ISO.
package main

import (
	"context"
	"fmt"

	"proxyfleet/pkg/agentcmd"
	"proxyfleet/pkg/service"
	"proxyfleet/services/proxmox-agent/internal/config"
	"proxyfleet/services/proxmox-agent/internal/nodes"
	"proxyfleet/services/proxmox-agent/internal/pve"
)

const name = "proxmox-agent"

const about = `
Runs the proxyfleet agent of one Proxmox VE cluster. Each node listed in the
configuration is a target with its own command consumer
(fleet.cmd.<entry>.<node>.*), heartbeat in fleet-agents and request
endpoints (fleet.agent.<entry>.<node>.{info,inventory,check}). Every proxy
is a linked (or full) clone of a template VM with a NoCloud seed ISO on
ide2; VMIDs are reserved in the fleet-vmids bucket before cloning.
See docs/proxmox.md for the configuration reference.`

func main() { agentcmd.Exit(spec()) }

// spec describes the command line; tests run it through [agentcmd.Main].
func spec() agentcmd.Spec[*config.Config] {
	return agentcmd.Spec[*config.Config]{
		Name: name, Synopsis: "[flags]", About: about,
		ConfigPath:  "/etc/proxyfleet/proxmox-agent.yaml",
		ConfigHolds: "entry, API URL, token file, TLS pin or CA, nodes, templates, seeds storage, bridge, VLAN, profiles",
		Load:        load,
		Serve: func(ctx context.Context, base *service.Base, cfg *config.Config, o agentcmd.Options) error {
			return nodes.Run(ctx, base.Conn, nodes.Options{Config: cfg, RecheckInterval: o.RecheckInterval, EgressEndpoints: o.EgressEndpoints, KeyDir: o.KeyDir,
				Log: base.Log, Tracer: base.Tel.Tracer})
		},
	}
}

// load reads the file and checks the token file and the TLS pin or CA
// with the rest of it.
func load(path string) (*config.Config, error) {
	cfg, err := config.Load(path)
	if err != nil {
		return nil, err
	}
	if _, err := pve.New(cfg.ClientConfig()); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return cfg, nil
}
