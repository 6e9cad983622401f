// Command kvm-agent is the proxyfleet agent of one libvirt host: it runs each
// proxy as a libvirt domain (a qcow2 overlay on a cached cloud image, a
// NoCloud seed ISO, Squid inside) and executes the planner's commands for
// its entry and target.
package main

import (
	"context"
	"flag"
	"fmt"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agentcmd"
	"proxyfleet/pkg/service"
	"proxyfleet/services/kvm-agent/internal/config"
	"proxyfleet/services/kvm-agent/internal/kvm"
)

const about = `
Runs the proxyfleet agent of one KVM host: every proxy is a libvirt domain
booted from a qcow2 overlay on a cached base image and configured by a
NoCloud seed ISO. It consumes fleet.cmd.<entry>.<target>.*, heartbeats into
fleet-agents and answers fleet.agent.<entry>.<target>.{info,inventory,check}.
Image download progress is published on fleet.progress.<entry>.<target>.
See docs/kvm.md for the configuration reference.`

func main() { agentcmd.Exit(spec()) }

// spec describes the command line; tests run it through [agentcmd.Main].
func spec() agentcmd.Spec[*config.Config] {
	var verbose bool
	return agentcmd.Spec[*config.Config]{
		Name: "kvm-agent", Synopsis: "[flags]", About: about,
		ConfigPath:  "/etc/proxyfleet/kvm-agent.yaml",
		ConfigHolds: "entry, target, libvirt connection, pool, network, images, profiles",
		Flags: func(fs *flag.FlagSet) {
			fs.BoolVar(&verbose, "log-libvirt-xml", false, "log domain and volume XML with each libvirt call (never user-data or upload bodies)")
		},
		Load: config.Load,
		Serve: func(ctx context.Context, base *service.Base, cfg *config.Config, o agentcmd.Options) error {
			stack := kvm.Open(cfg, kvm.Options{Log: base.Log, Tracer: base.Tel.Tracer, Publish: base.Conn.NC.Publish, VerboseRPC: verbose})
			defer stack.Close()
			rt, err := agent.New(base.Conn, stack.Driver, agent.Config{Info: stack.Driver.Info(), RecheckInterval: o.RecheckInterval, EgressEndpoints: o.EgressEndpoints, KeyDir: o.KeyDir}, base.Log, base.Tel.Tracer)
			if err != nil {
				return fmt.Errorf("agent runtime: %w", err)
			}
			return rt.Run(ctx)
		},
	}
}
