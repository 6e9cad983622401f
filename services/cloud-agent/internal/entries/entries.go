// Package entries serves the provider entries of one cloud-agent config
// file from one process: every target of every entry gets its own agent
// runtime, with the gce or kubernetes driver its entry's type names and one
// API client per entry.
package entries

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"time"

	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/cloudinit"
	"proxyfleet/services/cloud-agent/internal/config"
	"proxyfleet/services/cloud-agent/internal/gce"
	"proxyfleet/services/cloud-agent/internal/kube"
)

// Options are what [Run] serves and with what.
type Options struct {
	File *config.File
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

// Run serves every entry and target until ctx ends, or until one runtime
// fails, which stops them all (see [agent.RunAll]).
func Run(ctx context.Context, conn *bus.Conn, o Options) error {
	runners, err := Runtimes(ctx, conn, o)
	if err != nil {
		return err
	}
	if o.Log != nil {
		o.Log.Info("cloud-agent serving", "entries", len(o.File.Entries), "runtimes", len(runners))
	}
	return agent.RunAll(ctx, runners...)
}

// Runtimes builds the API client of every entry and one agent runtime per
// entry and target, without starting them.
func Runtimes(ctx context.Context, conn *bus.Conn, o Options) ([]agent.Runner, error) {
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	var runners []agent.Runner
	for _, e := range o.File.Entries {
		drivers, err := entryDrivers(ctx, e, o.Log.With("entry", e.Name))
		if err != nil {
			return nil, fmt.Errorf("entry %s: %w", e.Name, err)
		}
		for _, target := range e.Targets {
			images, profiles := catalog(e)
			info := agent.Info{Entry: e.Name, Target: target, Type: e.Type, Images: images, Profiles: profiles, Capacity: e.Capacity, Labels: e.LabelsOf(target)}
			rt, err := agent.New(conn, drivers[target], agent.Config{Info: info, CommandTimeout: time.Duration(e.CommandTimeout),
				RecheckInterval: o.RecheckInterval, EgressEndpoints: o.EgressEndpoints, KeyDir: o.KeyDir}, o.Log, o.Tracer)
			if err != nil {
				return nil, fmt.Errorf("entry %s, target %s: agent runtime: %w", e.Name, target, err)
			}
			runners = append(runners, rt)
		}
	}
	return runners, nil
}

// entryDrivers returns the driver of every target of e, sharing one client.
func entryDrivers(ctx context.Context, e config.Entry, log *slog.Logger) (map[string]agent.Driver, error) {
	drivers := map[string]agent.Driver{}
	switch e.Type {
	case config.TypeGCE:
		log := log.With("component", "gce")
		svc, err := gce.NewService(ctx, gce.ServiceOptions{CredentialsFile: e.GCE.CredentialsFile, Endpoint: e.GCE.Endpoint}, log)
		if err != nil {
			return nil, fmt.Errorf("gce client: %w", err)
		}
		for _, zone := range e.Targets {
			drivers[zone] = gce.New(svc, gce.Options{Entry: e.Name, Zone: zone, Zones: e.Targets, Config: *e.GCE,
				DefaultUserData: cloudinit.DefaultSquidUserData, Log: log})
		}
	case config.TypeKubernetes:
		rc, err := kube.RESTConfig(e.Kubernetes.Kubeconfig, e.Kubernetes.Context)
		if err != nil {
			return nil, fmt.Errorf("kubernetes client: %w", err)
		}
		rc.UserAgent = "proxyfleet-cloud-agent"
		api, err := kube.NewClient(rc)
		if err != nil {
			return nil, fmt.Errorf("kubernetes client: %w", err)
		}
		for _, ns := range e.Targets {
			drivers[ns] = kube.New(api, kube.Options{Entry: e.Name, Namespace: ns, Namespaces: e.Targets, Config: *e.Kubernetes,
				Log: log.With("component", "kubernetes")})
		}
	default:
		return nil, fmt.Errorf("type %q has no driver", e.Type)
	}
	return drivers, nil
}

// catalog returns the image and profile keys an entry announces, sorted.
func catalog(e config.Entry) (images, profiles []string) {
	switch {
	case e.GCE != nil:
		return slices.Sorted(maps.Keys(e.GCE.Images)), slices.Sorted(maps.Keys(e.GCE.Profiles))
	case e.Kubernetes != nil:
		return slices.Sorted(maps.Keys(e.Kubernetes.Images)), slices.Sorted(maps.Keys(e.Kubernetes.Profiles))
	}
	return nil, nil
}
