package proxmox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/proxmox-agent/internal/pve"
)

// Finding a proxy's VM in the cluster and telling whether it is ours.

// vmRef is a VM found in the cluster with its configuration.
type vmRef struct {
	vmid int
	node string
	cfg  pve.VMConfig
}

// locate finds VM vmid (on this node first, then anywhere in the cluster);
// nil means it does not exist.
func (d *Driver) locate(ctx context.Context, vmid int) (*vmRef, error) {
	cfg, err := d.api.Config(ctx, d.node, vmid)
	if err == nil {
		return &vmRef{vmid: vmid, node: d.node, cfg: cfg}, nil
	}
	if !errors.Is(err, agent.ErrNotFound) {
		return nil, fmt.Errorf("read VM %d: %w", vmid, err)
	}
	res, err := d.api.Resources(ctx, "vm")
	if err != nil {
		return nil, fmt.Errorf("list VMs: %w", err)
	}
	for _, r := range res {
		if r.VMID == vmid && r.Node != d.node {
			cfg, err := d.api.Config(ctx, r.Node, vmid)
			if errors.Is(err, agent.ErrNotFound) {
				return nil, nil
			}
			if err != nil {
				return nil, fmt.Errorf("read VM %d on %s: %w", vmid, r.Node, err)
			}
			return &vmRef{vmid: vmid, node: r.Node, cfg: cfg}, nil
		}
	}
	return nil, nil
}

// owns reports whether cfg is the VM of proxy: its description marker names
// the proxy, or (a clone that finished before it was configured) it bears
// the proxy's deterministic instance name.
func owns(cfg pve.VMConfig, proxy, name string) bool {
	if m, _, ok := parseDescription(cfg.Description); ok {
		return m.ProxyID == proxy
	}
	if m, ok := parseTags(cfg.Tags); ok {
		return m.ProxyID == proxy
	}
	return name != "" && cfg.Name == name
}

// marked reports whether cfg carries proxy's marker (description or tags):
// the only condition under which anything of the VM is destroyed.
func marked(cfg pve.VMConfig, proxy string) bool {
	if m, _, ok := parseDescription(cfg.Description); ok && m.ProxyID == proxy {
		return true
	}
	m, ok := parseTags(cfg.Tags)
	return ok && m.ProxyID == proxy
}

// waitCloned polls VM vmid until it no longer carries "lock: clone". It
// returns nil when the clone failed and left no VM.
func (d *Driver) waitCloned(ctx context.Context, vm *vmRef) (*vmRef, error) {
	t := time.NewTicker(d.poll)
	defer t.Stop()
	for vm != nil && vm.cfg.Lock == "clone" {
		select {
		case <-ctx.Done():
			return nil, agent.Wrapf(agent.ErrTransient, "VM %d is still being cloned: %w", vm.vmid, ctx.Err())
		case <-t.C:
		}
		next, err := d.locate(ctx, vm.vmid)
		if err != nil {
			if agent.Classify(err) == agent.ClassPermanent {
				return nil, err
			}
			continue
		}
		vm = next
	}
	return vm, nil
}

// find locates ref's VM: by its VMID, else by the VMID index, else by
// its name among the cluster's VMs.
func (d *Driver) find(ctx context.Context, ref agent.Ref) (*vmRef, error) {
	if vmid, ok := parseProviderID(ref.ProviderID); ok {
		vm, err := d.locate(ctx, vmid)
		if err != nil || (vm != nil && (vm.cfg.Lock == "clone" || owns(vm.cfg, ref.ProxyID, ref.Name))) {
			return vm, err
		}
	}
	return d.findByName(ctx, ref)
}

func (d *Driver) findByName(ctx context.Context, ref agent.Ref) (*vmRef, error) {
	if ref.Name == "" {
		return nil, nil
	}
	res, err := d.api.Resources(ctx, "vm")
	if err != nil {
		return nil, fmt.Errorf("list VMs: %w", err)
	}
	for _, r := range res {
		if r.Name != ref.Name || r.Template == 1 {
			continue
		}
		cfg, err := d.api.Config(ctx, r.Node, r.VMID)
		if errors.Is(err, agent.ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read VM %d: %w", r.VMID, err)
		}
		if owns(cfg, ref.ProxyID, ref.Name) {
			return &vmRef{vmid: r.VMID, node: r.Node, cfg: cfg}, nil
		}
	}
	return nil, nil
}
