package proxmox

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/proxmox-agent/internal/config"
	"proxyfleet/services/proxmox-agent/internal/pve"
)

// The lifecycle of a proxy VM as the runtime drives it: create, get,
// delete and list.

// Create builds spec's VM, or finishes what an earlier attempt started: it
// clones the template into the reserved VMID (unless that VM exists or is
// being cloned), uploads the seed ISO, configures ide2, net0, size, tags
// and description, and starts the VM. The address comes later, from the
// guest agent, through [Driver.Get].
func (d *Driver) Create(ctx context.Context, spec agent.Spec) (agent.Instance, error) {
	if _, ok := parseProviderID(spec.ProviderID); !ok {
		id, err := d.Prepare(ctx, spec)
		if err != nil {
			return agent.Instance{}, err
		}
		spec.ProviderID = id
	}
	vmid, _ := parseProviderID(spec.ProviderID)
	tmpl, err := d.template(spec.Image)
	if err != nil {
		return agent.Instance{}, err
	}
	var prof *config.Profile
	if spec.Profile != "" {
		p, err := agent.Lookup(d.cfg.Entry, "profile", d.cfg.Profiles, spec.Profile, "")
		if err != nil {
			return agent.Instance{}, err
		}
		prof = &p
	}
	log := d.log.With("proxy", spec.ProxyID, "vmid", vmid)

	vm, err := d.locate(ctx, vmid)
	if err != nil {
		return agent.Instance{}, err
	}
	if vm != nil && vm.cfg.Lock == "clone" {
		log.Info("VM is being cloned by an earlier attempt; waiting for it")
		if vm, err = d.waitCloned(ctx, vm); err != nil {
			return agent.Instance{}, err
		}
		if vm == nil {
			return agent.Instance{}, agent.Wrapf(agent.ErrTransient, "the clone into VMID %d an earlier attempt started failed; cloning again", vmid)
		}
	}
	if vm == nil {
		if vm, err = d.clone(ctx, spec, vmid, tmpl); err != nil {
			return agent.Instance{}, err
		}
	}
	if !owns(vm.cfg, spec.ProxyID, spec.Name) {
		d.release(ctx, vmid, spec.ProxyID)
		return agent.Instance{}, agent.Wrap(agent.ErrTransient, fmt.Errorf("VMID %d holds VM %q, which is not this proxy's: %w",
			vmid, vm.cfg.Name, pve.ErrVMIDTaken))
	}
	if !d.configured(vm.cfg, spec) {
		if err := d.configure(ctx, vm, spec, prof); err != nil {
			return agent.Instance{}, err
		}
	}
	st, err := d.api.Status(ctx, vm.node, vmid)
	if err != nil {
		return agent.Instance{}, fmt.Errorf("status of VM %d: %w", vmid, err)
	}
	if st.Status != "running" {
		upid, err := d.api.Start(ctx, vm.node, vmid)
		if err == nil {
			err = d.api.WaitTask(ctx, upid)
		}
		if err != nil {
			return agent.Instance{}, fmt.Errorf("start VM %d: %w", vmid, err)
		}
		log.Info("VM started")
	}
	return agent.Instance{Name: spec.Name, ProviderID: spec.ProviderID, Marker: spec.Marker(), State: agent.StateProvisioning,
		Detail: "started; waiting for the guest agent to report an address"}, nil
}

// Get reports the VM behind ref: provisioning while it is being cloned or
// its guest agent has no address yet, running with the guest's address,
// terminated when stopped. A VMID that no longer holds this proxy's VM is
// not found.
func (d *Driver) Get(ctx context.Context, ref agent.Ref) (agent.Instance, error) {
	inst := agent.Instance{Name: ref.Name, ProviderID: ref.ProviderID}
	vm, err := d.find(ctx, ref)
	if err != nil {
		return inst, err
	}
	if vm == nil {
		return inst, agent.Wrapf(agent.ErrNotFound, "VM of proxy %s (VMID %s) does not exist", ref.ProxyID, ref.ProviderID)
	}
	inst.ProviderID = strconv.Itoa(vm.vmid)
	if vm.cfg.Lock == "clone" {
		inst.State, inst.Detail = agent.StateProvisioning, "being cloned"
		return inst, nil
	}
	if !owns(vm.cfg, ref.ProxyID, ref.Name) {
		return inst, agent.Wrapf(agent.ErrNotFound, "VMID %d now holds VM %q, not proxy %s's", vm.vmid, vm.cfg.Name, ref.ProxyID)
	}
	m, port, _ := parseDescription(vm.cfg.Description)
	inst.Marker = m
	st, err := d.api.Status(ctx, vm.node, vm.vmid)
	if err != nil {
		return inst, fmt.Errorf("status of VM %d: %w", vm.vmid, err)
	}
	if st.Status != "running" {
		inst.State, inst.Detail = agent.StateTerminated, "VM is "+st.Status
		return inst, nil
	}
	ifs, err := d.api.NetworkInterfaces(ctx, vm.node, vm.vmid)
	if err != nil {
		// The guest agent answers about 50 s after start: until then the
		// VM has no address yet, which is not an error.
		inst.State, inst.Detail = agent.StateProvisioning, "waiting for the guest agent"
		return inst, nil
	}
	ip := guestIPv4(ifs)
	if ip == "" {
		inst.State, inst.Detail = agent.StateProvisioning, "guest agent reports no IPv4 address yet"
		return inst, nil
	}
	inst.State = agent.StateRunning
	inst.Address = net.JoinHostPort(ip, strconv.Itoa(port))
	return inst, nil
}

// guestIPv4 returns the first IPv4 address, not link-local, of an
// interface other than the guest's loopback interface "lo".
func guestIPv4(ifs []pve.Interface) string {
	for _, i := range ifs {
		if i.Name == "lo" {
			continue
		}
		for _, a := range i.IPAddresses {
			ip := net.ParseIP(a.Address)
			if a.Type != "ipv4" || ip == nil || ip.To4() == nil || ip.IsLinkLocalUnicast() || ip.IsUnspecified() {
				continue
			}
			return ip.String()
		}
	}
	return ""
}

// Delete destroys ref's VM if, and only if, it carries this proxy's marker:
// it stops it, destroys it with purge, removes the seed and releases the
// VMID reservation. A VMID holding someone else's VM is left alone.
func (d *Driver) Delete(ctx context.Context, ref agent.Ref) error {
	log := d.log.With("proxy", ref.ProxyID, "vmid", ref.ProviderID)
	vmids := map[int]bool{}
	if vmid, ok := parseProviderID(ref.ProviderID); ok {
		vmids[vmid] = true
	}
	if e, err := d.kv.Get(ctx, d.indexKey(ref.ProxyID)); err == nil {
		if vmid, ok := parseProviderID(string(e.Value())); ok {
			vmids[vmid] = true
		}
	}
	var targets []*vmRef
	for vmid := range vmids {
		vm, err := d.locate(ctx, vmid)
		if err != nil {
			return err
		}
		if vm != nil && vm.cfg.Lock == "clone" {
			log.Info("VM is being cloned; waiting before deciding whether it is ours", "vmid", vmid)
			if vm, err = d.waitCloned(ctx, vm); err != nil {
				return err
			}
		}
		switch {
		case vm == nil:
		case marked(vm.cfg, ref.ProxyID):
			targets = append(targets, vm)
		default:
			log.Warn("VMID holds a VM without this proxy's marker; leaving it untouched", "vmid", vmid, "vm_name", vm.cfg.Name)
		}
	}
	if len(targets) == 0 {
		vm, err := d.findByName(ctx, agent.Ref{ProxyID: ref.ProxyID, Name: ref.Name})
		if err != nil {
			return err
		}
		if vm != nil && marked(vm.cfg, ref.ProxyID) {
			targets = append(targets, vm)
		}
	}
	for _, vm := range targets {
		if err := d.destroy(ctx, vm); err != nil {
			return err
		}
		log.Info("VM destroyed", "vmid", vm.vmid)
	}
	if err := d.removeSeed(ctx, ref.Name); err != nil {
		return err
	}
	for vmid := range vmids {
		d.release(ctx, vmid, ref.ProxyID)
	}
	for _, vm := range targets {
		d.release(ctx, vm.vmid, ref.ProxyID)
	}
	return nil
}

// destroy stops vm, waits, and destroys it with purge.
func (d *Driver) destroy(ctx context.Context, vm *vmRef) error {
	st, err := d.api.Status(ctx, vm.node, vm.vmid)
	if errors.Is(err, agent.ErrNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("status of VM %d: %w", vm.vmid, err)
	}
	if st.Status == "running" {
		upid, err := d.api.Stop(ctx, vm.node, vm.vmid)
		if err == nil {
			err = d.api.WaitTask(ctx, upid)
		}
		if err != nil && !errors.Is(err, agent.ErrNotFound) {
			return fmt.Errorf("stop VM %d: %w", vm.vmid, err)
		}
	}
	upid, err := d.api.DeleteVM(ctx, vm.node, vm.vmid)
	if err == nil {
		err = d.api.WaitTask(ctx, upid)
	}
	if err != nil && !errors.Is(err, agent.ErrNotFound) {
		return fmt.Errorf("destroy VM %d: %w", vm.vmid, err)
	}
	return nil
}

// List returns this entry's marked VMs on this node from one
// /cluster/resources call (the marker is in the tags it returns).
func (d *Driver) List(ctx context.Context) ([]agent.Instance, error) {
	res, err := d.api.Resources(ctx, "vm")
	if err != nil {
		return nil, err
	}
	var out []agent.Instance
	for _, r := range res {
		m, ok := parseTags(r.Tags)
		if !ok || r.Node != d.node || m.Entry != d.cfg.Entry || r.Template == 1 {
			continue
		}
		inst := agent.Instance{Name: r.Name, ProviderID: strconv.Itoa(r.VMID), Marker: m, Detail: "VM is " + r.Status}
		switch {
		case r.Lock != "":
			inst.State = agent.StateProvisioning
			inst.Detail += " (lock " + r.Lock + ")"
		case r.Status == "running":
			inst.State = agent.StateProvisioning // the address needs the guest agent: see Get
		case r.Status == "stopped":
			// Stopped for good as far as we know: nothing here starts a
			// proxy's VM again. "unknown" (an offline node) is no verdict.
			inst.State = agent.StateTerminated
		}
		out = append(out, inst)
	}
	return out, nil
}
