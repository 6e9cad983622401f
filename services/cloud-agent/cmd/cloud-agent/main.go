// Command cloud-agent is the proxyfleet agent of the cloud backends: one
// process serves every entry of its config file, type gce (targets are
// zones) and type kubernetes (targets are namespaces), with one agent
// runtime per entry and target.
package main

import (
	"context"
	"errors"
	"io"
	"os"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agentconfig"
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

func main() { os.Exit(run(os.Args[1:], os.Stderr)) }

func run(args []string, stderr io.Writer) int {
	cmd := service.NewCommand("cloud-agent", "--config FILE [flags]", about, stderr)
	var cf agentconfig.Flags
	cf.Register(cmd.Flags, os.Getenv("PROXYFLEET_CLOUD_CONFIG"), "the entries this agent serves (env PROXYFLEET_CLOUD_CONFIG)")
	recheck := agent.RecheckFlag(cmd.Flags)
	if code, ok := cmd.Parse(args); !ok {
		return code
	}
	if cf.Path == "" {
		return cmd.Fail(2, errors.New("--config is required (see --help)"))
	}
	cfg, err := config.Load(cf.Path)
	if err != nil {
		return cmd.Fail(2, err)
	}
	if cf.Check {
		for _, e := range cfg.Entries {
			cmd.Printf("entry %s (%s): targets %v", e.Name, e.Type, e.Targets)
		}
		return 0
	}
	return cmd.Serve(func(ctx context.Context, base *service.Base) error {
		return entries.Run(ctx, base.Conn, entries.Options{File: cfg, RecheckInterval: *recheck, Log: base.Log, Tracer: base.Tel.Tracer})
	})
}
