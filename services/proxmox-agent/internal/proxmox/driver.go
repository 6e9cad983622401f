// Package proxmox is the proxmox-agent's [agent.Driver]: one proxy is one
// linked (or full) clone of a template VM on one Proxmox VE node, booted
// with a NoCloud seed ISO on ide2 and attached to the configured bridge and
// VLAN.
//
// VMIDs are the one thing Proxmox VE does not make safe: /cluster/nextid
// reserves nothing. The driver therefore reserves a VMID in the fleet-vmids
// bucket (a KV create is the reservation) in [Driver.Prepare], the runtime
// records it in the provisioning event before anything is cloned, and a
// retry after a crash finds the clone by that VMID instead of making a
// second one. A VM being cloned has no name yet and "lock: clone": it is in
// progress, never gone. Nothing is destroyed unless the VM at the VMID
// carries this proxy's marker.
package proxmox

import (
	"errors"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/proxmox-agent/internal/config"
	"proxyfleet/services/proxmox-agent/internal/pve"
)

// Compile-time checks of the capabilities the runtime looks for.
var (
	_ agent.Driver   = (*Driver)(nil)
	_ agent.Preparer = (*Driver)(nil)
)

// Options are everything a [Driver] uses.
type Options struct {
	Config *config.Config
	// Node is the Proxmox VE node this driver places proxies on (its target).
	Node   string
	Client *pve.Client
	// VMIDs is the fleet-vmids bucket, shared by every agent of the cluster.
	VMIDs jetstream.KeyValue
	Log   *slog.Logger
	// PollInterval is how often a VM being cloned by an earlier attempt is
	// looked at again (default 2s).
	PollInterval time.Duration
}

// Driver manages the proxy VMs of one node.
type Driver struct {
	cfg  *config.Config
	node string
	api  *pve.Client
	kv   jetstream.KeyValue
	log  *slog.Logger
	poll time.Duration
}

// New returns a driver for opts.Node.
func New(opts Options) (*Driver, error) {
	if opts.Config == nil || opts.Client == nil || opts.VMIDs == nil || opts.Node == "" {
		return nil, errors.New("proxmox driver: config, client, VMID bucket and node are required")
	}
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	poll := opts.PollInterval
	if poll <= 0 {
		poll = 2 * time.Second
	}
	return &Driver{cfg: opts.Config, node: opts.Node, api: opts.Client, kv: opts.VMIDs,
		log: log.With("node", opts.Node), poll: poll}, nil
}
