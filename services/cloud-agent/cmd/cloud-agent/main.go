// Command cloud-agent is the proxyfleet agent of the cloud backends: one
// process serves every entry of its config file, type gce (targets are
// zones) and type kubernetes (targets are namespaces), with one agent
// runtime per entry and target.
package main

import (
	"context"
	"fmt"
	"os"

	"proxyfleet/pkg/agentcmd"
	"proxyfleet/pkg/service"
	"proxyfleet/services/cloud-agent/internal/config"
	"proxyfleet/services/cloud-agent/internal/entries"
)

const about = `
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
status, duration) and never tokens, keys or user-data.`

func main() { agentcmd.Exit(spec()) }

// spec describes the command line; tests run it through [agentcmd.Main].
func spec() agentcmd.Spec[*config.File] {
	return agentcmd.Spec[*config.File]{
		Name: "cloud-agent", Synopsis: "--config FILE [flags]", About: about,
		ConfigPath:  os.Getenv("PROXYFLEET_CLOUD_CONFIG"),
		ConfigHolds: "the entries this agent serves (env PROXYFLEET_CLOUD_CONFIG)",
		Load:        config.Load,
		Valid: func(_ string, cfg *config.File) []string {
			var lines []string
			for _, e := range cfg.Entries {
				lines = append(lines, fmt.Sprintf("entry %s (%s): targets %v", e.Name, e.Type, e.Targets))
			}
			return lines
		},
		Serve: func(ctx context.Context, base *service.Base, cfg *config.File, o agentcmd.Options) error {
			return entries.Run(ctx, base.Conn, entries.Options{File: cfg, RecheckInterval: o.RecheckInterval, EgressEndpoints: o.EgressEndpoints, KeyDir: o.KeyDir, Log: base.Log, Tracer: base.Tel.Tracer})
		},
	}
}
