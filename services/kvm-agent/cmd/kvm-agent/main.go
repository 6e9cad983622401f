// Command kvm-agent is the proxyfleet agent of one libvirt host: it runs each
// proxy as a libvirt domain (a qcow2 overlay on a cached cloud image, a
// NoCloud seed ISO, Squid inside) and executes the planner's commands for
// its entry and target.
package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agentconfig"
	"proxyfleet/pkg/service"
	"proxyfleet/services/kvm-agent/internal/config"
	"proxyfleet/services/kvm-agent/internal/kvm"
)

// version is set at build time with -ldflags "-X main.version=…".
var version = "dev"

const about = `
Runs the proxyfleet agent of one KVM host: every proxy is a libvirt domain
booted from a qcow2 overlay on a cached base image and configured by a
NoCloud seed ISO. It consumes fleet.cmd.<entry>.<target>.*, heartbeats into
fleet-agents and answers fleet.agent.<entry>.<target>.{info,inventory,check}.
Image download progress is published on fleet.progress.<entry>.<target>.
See docs/kvm.md for the configuration reference.`

func main() { os.Exit(run(os.Args[1:], os.Stderr)) }

func run(args []string, stderr io.Writer) int {
	cmd := service.NewCommand("kvm-agent", "[flags]", about, stderr)
	var cf agentconfig.Flags
	cf.Register(cmd.Flags, "/etc/proxyfleet/kvm-agent.yaml", "entry, target, libvirt connection, pool, network, images, profiles")
	recheck := agent.RecheckFlag(cmd.Flags)
	verbose := cmd.Flags.Bool("log-libvirt-xml", false, "log domain and volume XML with each libvirt call (never user-data or upload bodies)")
	if code, ok := cmd.Parse(args); !ok {
		return code
	}
	cfg, err := config.Load(cf.Path)
	if err != nil {
		return cmd.Fail(2, err)
	}
	if cf.Check {
		cmd.Printf("%s is valid", cf.Path)
		return 0
	}
	return cmd.Serve(func(ctx context.Context, base *service.Base) error {
		stack := kvm.Open(cfg, kvm.Options{Log: base.Log, Tracer: base.Tel.Tracer, Publish: base.Conn.NC.Publish, VerboseRPC: *verbose})
		defer stack.Close()
		rt, err := agent.New(base.Conn, stack.Driver, agent.Config{Info: stack.Driver.Info(version), RecheckInterval: *recheck}, base.Log, base.Tel.Tracer)
		if err != nil {
			return fmt.Errorf("agent runtime: %w", err)
		}
		return rt.Run(ctx)
	})
}
