// Command kvm-agent is the proxyfleet agent of one libvirt host: it runs each
// proxy as a libvirt domain (a qcow2 overlay on a cached cloud image, a
// NoCloud seed ISO, Squid inside) and executes the planner's commands for
// its entry and target.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/service"
	"proxyfleet/services/kvm-agent/internal/config"
	"proxyfleet/services/kvm-agent/internal/kvm"
)

const name = "kvm-agent"

// version is set at build time with -ldflags "-X main.version=…".
var version = "dev"

func main() { os.Exit(run(os.Args[1:], os.Stderr)) }

func run(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	var common service.Flags
	common.Register(fs, name)
	cfgPath := fs.String("config", "/etc/proxyfleet/kvm-agent.yaml", "configuration file (YAML): entry, target, libvirt connection, pool, network, images, profiles")
	check := fs.Bool("check-config", false, "validate the configuration file and exit")
	recheck := agent.RecheckFlag(fs)
	verbose := fs.Bool("log-libvirt-xml", false, "log domain and volume XML with each libvirt call (never user-data or upload bodies)")
	fs.Usage = func() {
		fmt.Fprintf(stderr, `Usage: %s [flags]

Runs the proxyfleet agent of one KVM host: every proxy is a libvirt domain
booted from a qcow2 overlay on a cached base image and configured by a
NoCloud seed ISO. It consumes fleet.cmd.<entry>.<target>.*, heartbeats into
fleet-agents and answers fleet.agent.<entry>.<target>.{info,inventory,check}.
Image download progress is published on fleet.progress.<entry>.<target>.
See docs/kvm.md for the configuration reference.

Flags:
`, name)
		fs.PrintDefaults()
	}
	if code, ok := service.ParseArgs(fs, args, stderr); !ok {
		return code
	}
	cfg, err := config.Load(*cfgPath)
	if err != nil {
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
	stack := kvm.Open(cfg, kvm.Options{Log: base.Log, Tracer: base.Tel.Tracer, Publish: base.Conn.NC.Publish, VerboseRPC: *verbose})
	defer stack.Close()
	rt, err := agent.New(base.Conn, stack.Driver, agent.Config{Info: stack.Driver.Info(version), RecheckInterval: *recheck}, base.Log, base.Tel.Tracer)
	if err != nil {
		base.Log.Error("agent runtime", "err", err)
		return 1
	}
	if err := rt.Run(ctx); err != nil {
		base.Log.Error("agent stopped", "err", err)
		return 1
	}
	return 0
}
