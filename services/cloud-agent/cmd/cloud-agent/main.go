// Command cloud-agent is the proxyfleet agent of the cloud backends: one
// process serves every entry of its config file, type gce (targets are
// zones) and type kubernetes (targets are namespaces), with one agent
// runtime per entry and target.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"k8s.io/client-go/kubernetes"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/cloudinit"
	"proxyfleet/pkg/service"
	"proxyfleet/services/cloud-agent/internal/config"
	"proxyfleet/services/cloud-agent/internal/gce"
	"proxyfleet/services/cloud-agent/internal/kube"
)

const name = "cloud-agent"

func main() { os.Exit(run(os.Args[1:], os.Stderr)) }

func run(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	var common service.Flags
	common.Register(fs, name)
	configPath := fs.String("config", os.Getenv("PROXYFLEET_CLOUD_CONFIG"),
		"config file listing the entries this agent serves (env PROXYFLEET_CLOUD_CONFIG)")
	check := fs.Bool("check-config", false, "validate the config file, print its entries and targets, and exit")
	recheck := agent.RecheckFlag(fs)
	fs.Usage = func() {
		fmt.Fprintf(stderr, `Usage: %s --config FILE [flags]

Runs the proxyfleet agent of the cloud backends. Every entry of the config
file is one provider entry; every target of an entry gets its own agent
runtime, consuming fleet.cmd.<entry>.<target>.* and answering
fleet.agent.<entry>.<target>.{info,inventory,check}.

  type gce         targets are zones of gce.project; one instance per proxy,
                   cloud-init in metadata user-data, the marker as labels.
                   Credentials: gce.credentialsFile (a service-account key)
                   or application default credentials.
  type kubernetes  targets are namespaces; one Squid Pod per proxy with its
                   configuration in a Secret, the marker as labels.
                   Credentials: kubernetes.kubeconfig, or the in-cluster
                   service account when empty.

Example config:

  entries:
    - name: gce-eu
      type: gce
      targets: [europe-west1-b, europe-west1-c]
      gce:
        project: my-project
        images: {debian-12: projects/debian-cloud/global/images/family/debian-12}
        defaultImage: debian-12
        profiles: {small: e2-small}
        defaultProfile: small
        externalIP: true
    - name: k8s
      type: kubernetes
      targets: [proxies]

See docs/gce.md and docs/kubernetes.md for every field and the permissions
each backend needs. Debug logs show one line per API call (method, path,
status, duration) and never tokens, keys or user-data.

Flags:
`, name)
		fs.PrintDefaults()
	}
	if code, ok := service.ParseArgs(fs, args, stderr); !ok {
		return code
	}
	if *configPath == "" {
		fmt.Fprintf(stderr, "%s: --config is required (see --help)\n", name)
		return 2
	}
	cfg, err := config.Load(*configPath)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return 2
	}
	if *check {
		for _, e := range cfg.Entries {
			fmt.Fprintf(stderr, "entry %s (%s): targets %v\n", e.Name, e.Type, e.Targets)
		}
		return 0
	}
	return serve(common, cfg, *recheck)
}

func serve(common service.Flags, cfg *config.File, recheck time.Duration) int {
	ctx, stop := service.SignalContext()
	defer stop()
	base, err := service.Start(ctx, name, common)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		return 1
	}
	defer base.Close()

	var runtimes []*agent.Runtime
	for _, e := range cfg.Entries {
		log := base.Log.With("entry", e.Name)
		drivers := map[string]agent.Driver{}
		switch e.Type {
		case config.TypeGCE:
			svc, err := gce.NewService(ctx, gce.ServiceOptions{CredentialsFile: e.GCE.CredentialsFile, Endpoint: e.GCE.Endpoint}, log.With("component", "gce"))
			if err != nil {
				base.Log.Error("gce client", "entry", e.Name, "err", err)
				return 1
			}
			for _, zone := range e.Targets {
				drivers[zone] = gce.New(svc, gce.Options{Entry: e.Name, Zone: zone, Zones: e.Targets, Config: *e.GCE,
					DefaultUserData: cloudinit.DefaultSquidUserData, Log: log.With("component", "gce")})
			}
		case config.TypeKubernetes:
			rc, err := kube.RESTConfig(e.Kubernetes.Kubeconfig, e.Kubernetes.Context)
			if err != nil {
				base.Log.Error("kubernetes client", "entry", e.Name, "err", err)
				return 1
			}
			rc.UserAgent = "proxyfleet-cloud-agent"
			cs, err := kubernetes.NewForConfig(rc)
			if err != nil {
				base.Log.Error("kubernetes client", "entry", e.Name, "err", err)
				return 1
			}
			for _, ns := range e.Targets {
				drivers[ns] = kube.New(cs, kube.Options{Entry: e.Name, Namespace: ns, Namespaces: e.Targets, Config: *e.Kubernetes,
					Log: log.With("component", "kubernetes")})
			}
		}
		for _, target := range e.Targets {
			info := agent.Info{Entry: e.Name, Target: target, Type: e.Type, Images: e.ImageKeys(), Profiles: e.ProfileKeys(), Capacity: e.Capacity}
			rt, err := agent.New(base.Conn, drivers[target], agent.Config{Info: info, CommandTimeout: time.Duration(e.CommandTimeout), RecheckInterval: recheck}, base.Log, base.Tel.Tracer)
			if err != nil {
				base.Log.Error("agent runtime", "entry", e.Name, "target", target, "err", err)
				return 1
			}
			runtimes = append(runtimes, rt)
		}
	}

	// Each runtime serves until ctx ends; one failing stops the process so
	// a supervisor restarts it whole.
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, len(runtimes))
	for _, rt := range runtimes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := rt.Run(rctx); err != nil {
				errs <- err
				cancel()
			}
		}()
	}
	base.Log.Info("cloud-agent serving", "entries", len(cfg.Entries), "runtimes", len(runtimes))
	wg.Wait()
	close(errs)
	code := 0
	for err := range errs {
		base.Log.Error("agent runtime stopped", "err", err)
		code = 1
	}
	return code
}
