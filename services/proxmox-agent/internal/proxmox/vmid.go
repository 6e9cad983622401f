package proxmox

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
)

// The VMID reservation protocol: a VMID is reserved in the fleet-vmids
// bucket, and indexed by proxy, before anything is cloned at it.

// parseProviderID reads a provider ID: the decimal VMID (VMIDs are unique
// in a cluster, and start at 100).
func parseProviderID(id string) (int, bool) {
	n, err := strconv.Atoi(id)
	return n, err == nil && n >= 100
}

// Reservation keys in fleet-vmids: "<cluster>.<vmid>" holds the proxy id
// (the reservation), "<cluster>.proxy.<proxy>" holds the VMID (an index, so
// a retry that lost its provisioning event finds its reservation).
func (d *Driver) resKey(vmid int) string       { return d.cfg.Cluster + "." + strconv.Itoa(vmid) }
func (d *Driver) indexKey(proxy string) string { return d.cfg.Cluster + ".proxy." + proxy }

// Prepare reserves the VMID of spec's VM and returns it as the provider ID.
// A VMID an earlier attempt recorded is kept while it is still this
// proxy's: reserved for it and either free, being cloned, or holding its
// VM. Otherwise a new VMID is reserved, starting from /cluster/nextid and
// skipping ids that exist or that another agent reserved.
func (d *Driver) Prepare(ctx context.Context, spec agent.Spec) (string, error) {
	if vmid, ok := parseProviderID(spec.ProviderID); ok {
		keep, err := d.stillOurs(ctx, spec, vmid)
		if err != nil {
			return "", err
		}
		if keep {
			return spec.ProviderID, nil
		}
	}
	if e, err := d.kv.Get(ctx, d.indexKey(spec.ProxyID)); err == nil {
		if vmid, ok := parseProviderID(string(e.Value())); ok && strconv.Itoa(vmid) != spec.ProviderID {
			keep, err := d.stillOurs(ctx, spec, vmid)
			if err != nil {
				return "", err
			}
			if keep {
				return strconv.Itoa(vmid), nil
			}
		}
	} else if !errors.Is(err, jetstream.ErrKeyNotFound) {
		return "", agent.Wrapf(agent.ErrTransient, "read VMID index: %w", err)
	}
	vmid, err := d.allocate(ctx, spec.ProxyID)
	if err != nil {
		return "", err
	}
	d.log.Info("reserved VMID", "proxy", spec.ProxyID, "vmid", vmid)
	return strconv.Itoa(vmid), nil
}

// stillOurs reports whether vmid may still be used for spec's VM.
func (d *Driver) stillOurs(ctx context.Context, spec agent.Spec, vmid int) (bool, error) {
	e, err := d.kv.Get(ctx, d.resKey(vmid))
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		if _, err := d.kv.Create(ctx, d.resKey(vmid), []byte(spec.ProxyID)); errors.Is(err, jetstream.ErrKeyExists) {
			return false, nil
		} else if err != nil {
			return false, agent.Wrapf(agent.ErrTransient, "reserve VMID %d: %w", vmid, err)
		}
	case err != nil:
		return false, agent.Wrapf(agent.ErrTransient, "read VMID reservation %d: %w", vmid, err)
	case string(e.Value()) != spec.ProxyID:
		return false, nil
	}
	vm, err := d.locate(ctx, vmid)
	if err != nil {
		return false, err
	}
	switch {
	case vm == nil, vm.cfg.Lock == "clone", owns(vm.cfg, spec.ProxyID, spec.Name):
		return true, nil
	}
	d.log.Warn("VMID reserved for this proxy holds a VM that is not its own; reserving another",
		"proxy", spec.ProxyID, "vmid", vmid, "vm_name", vm.cfg.Name)
	d.release(ctx, vmid, spec.ProxyID)
	return false, nil
}

// allocate reserves a free VMID for proxy.
func (d *Driver) allocate(ctx context.Context, proxy string) (int, error) {
	hint, err := d.api.NextID(ctx)
	if err != nil {
		return 0, fmt.Errorf("next VMID: %w", err)
	}
	res, err := d.api.Resources(ctx, "vm")
	if err != nil {
		return 0, fmt.Errorf("list VMs: %w", err)
	}
	taken := make(map[int]bool, len(res))
	for _, r := range res {
		taken[r.VMID] = true
	}
	for cand, tries := hint, 0; tries < 10000 && cand <= 999999999; cand, tries = cand+1, tries+1 {
		if taken[cand] {
			continue
		}
		// The index first: a crash after it leaves nothing reserved, a
		// crash after the reservation leaves an index that finds it.
		if _, err := d.kv.Put(ctx, d.indexKey(proxy), []byte(strconv.Itoa(cand))); err != nil {
			return 0, agent.Wrapf(agent.ErrTransient, "record VMID index: %w", err)
		}
		_, err := d.kv.Create(ctx, d.resKey(cand), []byte(proxy))
		if errors.Is(err, jetstream.ErrKeyExists) {
			continue
		}
		if err != nil {
			return 0, agent.Wrapf(agent.ErrTransient, "reserve VMID %d: %w", cand, err)
		}
		return cand, nil
	}
	return 0, agent.Wrapf(agent.ErrQuotaExceeded, "no free VMID from %d on", hint)
}

// release drops the reservation of vmid and the index of proxy, each only
// while it still names the other.
func (d *Driver) release(ctx context.Context, vmid int, proxy string) {
	if e, err := d.kv.Get(ctx, d.resKey(vmid)); err == nil && string(e.Value()) == proxy {
		if err := d.kv.Delete(ctx, d.resKey(vmid), jetstream.LastRevision(e.Revision())); err != nil {
			d.log.Warn("release VMID reservation", "vmid", vmid, "err", err)
		}
	}
	if e, err := d.kv.Get(ctx, d.indexKey(proxy)); err == nil && string(e.Value()) == strconv.Itoa(vmid) {
		if err := d.kv.Delete(ctx, d.indexKey(proxy), jetstream.LastRevision(e.Revision())); err != nil {
			d.log.Warn("release VMID index", "proxy", proxy, "err", err)
		}
	}
}
