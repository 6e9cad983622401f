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
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/cloudinit"
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

// ProviderID is the decimal VMID (VMIDs are unique in a cluster).
func parseProviderID(id string) (int, bool) {
	n, err := strconv.Atoi(id)
	return n, err == nil && n >= 100
}

// Reservation keys in fleet-vmids: "<cluster>.<vmid>" holds the proxy id
// (the reservation), "<cluster>.proxy.<proxy>" holds the VMID (an index, so
// a retry that lost its provisioning event finds its reservation).
func (d *Driver) resKey(vmid int) string       { return d.cfg.Cluster + "." + strconv.Itoa(vmid) }
func (d *Driver) indexKey(proxy string) string { return d.cfg.Cluster + ".proxy." + proxy }

func seedFile(name string) string               { return name + ".iso" }
func (d *Driver) seedVolume(name string) string { return d.cfg.SeedsStorage + ":iso/" + seedFile(name) }

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
		p, ok := d.cfg.Profiles[spec.Profile]
		if !ok {
			return agent.Instance{}, agent.Wrapf(agent.ErrPermanent, "machine profile %q is not configured on entry %s (have %s)",
				spec.Profile, d.cfg.Entry, strings.Join(d.cfg.ProfileNames(), ", "))
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

func (d *Driver) template(image string) (int, error) {
	if image == "" && len(d.cfg.Templates) == 1 {
		for _, id := range d.cfg.Templates {
			return id, nil
		}
	}
	id, ok := d.cfg.Templates[image]
	if !ok {
		return 0, agent.Wrapf(agent.ErrPermanent, "image %q has no template on entry %s (have %s)",
			image, d.cfg.Entry, strings.Join(d.cfg.ImageKeys(), ", "))
	}
	return id, nil
}

// clone clones template tmpl into vmid and waits for the task.
func (d *Driver) clone(ctx context.Context, spec agent.Spec, vmid, tmpl int) (*vmRef, error) {
	src, err := d.locate(ctx, tmpl)
	if err != nil {
		return nil, fmt.Errorf("template %d: %w", tmpl, err)
	}
	if src == nil {
		return nil, agent.Wrapf(agent.ErrPermanent, "template VM %d for image %q does not exist", tmpl, spec.Image)
	}
	if src.cfg.Template != 1 {
		return nil, agent.Wrapf(agent.ErrPermanent, "VM %d for image %q is not a template; convert it with qm template %d", tmpl, spec.Image, tmpl)
	}
	opts := pve.CloneOptions{Name: spec.Name, Description: description(spec.Marker(), spec.Port),
		Full: d.cfg.Clone == config.CloneFull, Storage: d.cfg.CloneStorage, Target: d.node}
	upid, err := d.api.Clone(ctx, src.node, tmpl, vmid, opts)
	if err != nil {
		return nil, fmt.Errorf("clone template %d into VM %d: %w", tmpl, vmid, err)
	}
	d.log.Info("clone started", "proxy", spec.ProxyID, "vmid", vmid, "template", tmpl, "upid", upid)
	if err := d.api.WaitTask(ctx, upid); err != nil {
		return nil, fmt.Errorf("clone template %d into VM %d: %w", tmpl, vmid, err)
	}
	vm, err := d.locate(ctx, vmid)
	if err != nil {
		return nil, err
	}
	if vm == nil {
		return nil, agent.Wrapf(agent.ErrTransient, "VM %d is missing after its clone task succeeded", vmid)
	}
	return vm, nil
}

// netConfig is the net0 value: the clone's NIC (model and MAC, and options
// such as firewall or mtu kept) on the configured bridge, tagged when a VLAN
// is configured.
func (d *Driver) netConfig(current string) string {
	parts := strings.Split(current, ",")
	model := "virtio"
	if m := parts[0]; strings.Contains(m, "=") || m == "virtio" || m == "e1000" {
		if k, _, _ := strings.Cut(m, "="); k != "bridge" && k != "tag" {
			model = m
			parts = parts[1:]
		}
	}
	out := []string{model, "bridge=" + d.cfg.Bridge}
	for _, p := range parts {
		k, _, _ := strings.Cut(p, "=")
		if p == "" || k == "bridge" || k == "tag" {
			continue
		}
		out = append(out, p)
	}
	if d.cfg.VLANTag > 0 {
		out = append(out, "tag="+strconv.Itoa(d.cfg.VLANTag))
	}
	return strings.Join(out, ",")
}

func (d *Driver) ide2(name string) string { return d.seedVolume(name) + ",media=cdrom" }

// configured reports whether an earlier attempt finished configuring cfg.
// Proxmox VE appends the size to a CD-ROM drive ("…,media=cdrom,size=364K"),
// so only the volume is compared.
func (d *Driver) configured(cfg pve.VMConfig, spec agent.Spec) bool {
	m, ok := parseTags(cfg.Tags)
	vol, _, _ := strings.Cut(cfg.IDE2, ",")
	return ok && m.ProxyID == spec.ProxyID && vol == d.seedVolume(spec.Name) && sameNet(cfg.Net0, d.netConfig(cfg.Net0))
}

// sameNet compares two net0 values as sets of options.
func sameNet(a, b string) bool {
	as, bs := strings.Split(a, ","), strings.Split(b, ",")
	if len(as) != len(bs) {
		return false
	}
	slices.Sort(as)
	slices.Sort(bs)
	return slices.Equal(as, bs)
}

// configure (re)builds and uploads the seed and writes ide2, net0, size,
// tags and description in one configuration change.
func (d *Driver) configure(ctx context.Context, vm *vmRef, spec agent.Spec, prof *config.Profile) error {
	userData := spec.UserData
	if len(userData) == 0 {
		userData = cloudinit.DefaultSquidUserData(spec.Port, spec.Auth)
	}
	iso, err := cloudinit.BuildISO(cloudinit.Seed{
		InstanceID:        spec.Name + "-" + strconv.Itoa(vm.vmid),
		Hostname:          spec.Name,
		UserData:          userData,
		InstallGuestAgent: d.cfg.GuestAgent(),
	})
	if err != nil {
		return agent.Wrapf(agent.ErrTransient, "build seed ISO: %w", err)
	}
	// The seed is rebuilt on every configure: a cancelled upload may have
	// left a truncated one, and the storage refuses to overwrite a file.
	if err := d.removeSeed(ctx, spec.Name); err != nil {
		return err
	}
	upid, err := d.api.Upload(ctx, vm.node, d.cfg.SeedsStorage, "iso", seedFile(spec.Name), iso)
	if err == nil {
		err = d.api.WaitTask(ctx, upid)
	}
	if err != nil {
		return fmt.Errorf("upload seed %s to storage %s: %w", seedFile(spec.Name), d.cfg.SeedsStorage, err)
	}
	q := url.Values{
		"ide2":        {d.ide2(spec.Name)},
		"net0":        {d.netConfig(vm.cfg.Net0)},
		"agent":       {"1"},
		"tags":        {tags(spec.Marker())},
		"description": {description(spec.Marker(), spec.Port)},
	}
	if prof != nil {
		q.Set("cores", strconv.Itoa(prof.Cores))
		q.Set("memory", strconv.Itoa(prof.MemoryMiB))
	}
	if vm.cfg.Digest != "" {
		q.Set("digest", vm.cfg.Digest)
	}
	if err := d.api.SetConfig(ctx, vm.node, vm.vmid, q); err != nil {
		return fmt.Errorf("configure VM %d: %w", vm.vmid, err)
	}
	return nil
}

// removeSeed deletes the seed ISO of instance name; a missing one is fine.
func (d *Driver) removeSeed(ctx context.Context, name string) error {
	upid, err := d.api.DeleteVolume(ctx, d.node, d.cfg.SeedsStorage, d.seedVolume(name))
	if err == nil {
		err = d.api.WaitTask(ctx, upid)
	}
	if err != nil && !errors.Is(err, agent.ErrNotFound) {
		return fmt.Errorf("remove seed %s: %w", d.seedVolume(name), err)
	}
	return nil
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

// Check reports the API version, whether the node is online, each
// template, and whether the seeds (and full-clone) storage is active with
// enough free space. It never fails as a whole.
func (d *Driver) Check(ctx context.Context) []agent.Verdict {
	var out []agent.Verdict
	v, err := d.api.Version(ctx)
	if err != nil {
		out = append(out, agent.Verdict{Check: "api", OK: false, Detail: err.Error()})
	} else {
		out = append(out, agent.Verdict{Check: "api", OK: true, Detail: "Proxmox VE " + v.Version})
	}
	res, err := d.api.Resources(ctx, "")
	if err != nil {
		return append(out, agent.Verdict{Check: "node " + d.node, OK: false, Detail: err.Error()})
	}
	node := agent.Verdict{Check: "node " + d.node, Detail: "not in the cluster"}
	vms := map[int]pve.Resource{}
	storages := map[string]pve.Resource{}
	for _, r := range res {
		switch {
		case r.Type == "node" && r.Node == d.node:
			node.OK, node.Detail = r.Status == "online", r.Status
		case r.Type == "storage" && r.Node == d.node:
			storages[r.Storage] = r
		case r.Type == "qemu":
			vms[r.VMID] = r
		}
	}
	out = append(out, node)
	for _, key := range d.cfg.ImageKeys() {
		id := d.cfg.Templates[key]
		r, ok := vms[id]
		vd := agent.Verdict{Check: "template " + key, OK: ok && r.Template == 1}
		switch {
		case !ok:
			vd.Detail = fmt.Sprintf("VM %d does not exist", id)
		case r.Template != 1:
			vd.Detail = fmt.Sprintf("VM %d is not a template", id)
		default:
			vd.Detail = fmt.Sprintf("VM %d %s on %s", id, r.Name, r.Node)
		}
		out = append(out, vd)
	}
	names := []string{d.cfg.SeedsStorage}
	if d.cfg.CloneStorage != "" {
		names = append(names, d.cfg.CloneStorage)
	}
	for _, name := range names {
		r, ok := storages[name]
		vd := agent.Verdict{Check: "storage " + name}
		switch {
		case !ok:
			vd.Detail = "not on node " + d.node
		case r.Status != "available":
			vd.Detail = "not active: " + r.Status
		default:
			free := (r.MaxDisk - r.Disk) >> 20
			vd.OK = free >= d.cfg.MinFreeMiB
			vd.Detail = fmt.Sprintf("%d MiB free of %d MiB (minimum %d MiB)", free, r.MaxDisk>>20, d.cfg.MinFreeMiB)
		}
		out = append(out, vd)
	}
	return out
}
