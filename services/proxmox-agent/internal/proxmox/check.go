package proxmox

import (
	"context"
	"fmt"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/proxmox-agent/internal/pve"
)

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
