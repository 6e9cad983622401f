package proxmox

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/cloudinit"
	"proxyfleet/services/proxmox-agent/internal/config"
	"proxyfleet/services/proxmox-agent/internal/pve"
)

// Building a proxy VM: the clone of a template, its seed ISO and its
// network.

func seedFile(name string) string               { return name + ".iso" }
func (d *Driver) seedVolume(name string) string { return d.cfg.SeedsStorage + ":iso/" + seedFile(name) }

func (d *Driver) template(image string) (int, error) {
	var def string // the only template is the default
	if keys := d.cfg.ImageKeys(); len(keys) == 1 {
		def = keys[0]
	}
	return agent.Lookup(d.cfg.Entry, "image", d.cfg.Templates, image, def)
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
		var err error
		if userData, err = cloudinit.DefaultSquidUserData(spec.Port, spec.Auth, spec.Egress); err != nil {
			return agent.Wrapf(agent.ErrPermanent, "pool %s: %w", spec.Pool, err)
		}
	}
	// The instance id is the instance name, as on kvm: every clone is a
	// fresh disk, so cloud-init runs on first boot anyway, and the same
	// proxy gets the same seed bytes on every backend that boots cloud
	// images (TestSeedIsTheOneThatBootedOnKVM).
	iso, err := cloudinit.BuildISO(cloudinit.Seed{
		InstanceID:        spec.Name,
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
