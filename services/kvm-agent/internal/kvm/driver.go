// Package kvm is the kvm-agent's [agent.Driver]: one libvirt domain per
// proxy on one host, booted from a qcow2 overlay on a cached base image and
// configured by a NoCloud seed ISO.
package kvm

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	golibvirt "github.com/digitalocean/go-libvirt"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/cloudinit"
	"proxyfleet/services/kvm-agent/internal/config"
	"proxyfleet/services/kvm-agent/internal/image"
	"proxyfleet/services/kvm-agent/internal/libvirt"
)

// Images is what the driver needs of the image cache.
type Images interface {
	Ensure(ctx context.Context, src image.Source) (image.Base, error)
}

// Driver runs proxies as libvirt domains on one host.
type Driver struct {
	cfg    *config.Config
	rpc    libvirt.RPC // shared connection
	probe  libvirt.RPC // health checks: abandon instead of killing the connection
	images Images
	log    *slog.Logger
}

var _ agent.Driver = (*Driver)(nil)

// New returns a driver. rpc carries the work; probe carries checks.
func New(cfg *config.Config, rpc, probe libvirt.RPC, images Images, log *slog.Logger) *Driver {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Driver{cfg: cfg, rpc: rpc, probe: probe, images: images, log: log}
}

// OverlayName and SeedName are the per-instance volumes.
func OverlayName(instance string) string { return instance + ".qcow2" }

// SeedName is the seed ISO volume of an instance.
func SeedName(instance string) string { return instance + "-cidata.iso" }

// ProviderID is "<target>/<domain>".
func (d *Driver) providerID(name string) string { return d.cfg.Target + "/" + name }

// Info is what the agent announces.
func (d *Driver) Info() agent.Info {
	return agent.Info{Entry: d.cfg.Entry, Target: d.cfg.Target, Type: "kvm", Capacity: d.cfg.Capacity, Labels: d.cfg.Labels,
		Images: slices.Sorted(maps.Keys(d.cfg.Images)), Profiles: slices.Sorted(maps.Keys(d.cfg.Profiles))}
}

// Create makes (or finds) the domain of spec and starts it.
func (d *Driver) Create(ctx context.Context, spec agent.Spec) (agent.Instance, error) {
	imgKey := cmp.Or(spec.Image, d.cfg.DefaultImage)
	img, err := agent.Lookup(d.cfg.Entry, "image", d.cfg.Images, imgKey, "")
	if err != nil {
		return agent.Instance{}, err
	}
	prof, err := agent.Lookup(d.cfg.Entry, "profile", d.cfg.Profiles, spec.Profile, d.cfg.DefaultProfile)
	if err != nil {
		return agent.Instance{}, err
	}
	inst := agent.Instance{Name: spec.Name, ProviderID: d.providerID(spec.Name), Marker: spec.Marker(), State: agent.StateProvisioning}

	dom, err := d.rpc.DomainLookupByName(ctx, spec.Name)
	if err == nil {
		// An earlier attempt defined it (perhaps crashing before the start).
		m, err := d.marker(ctx, dom)
		if err != nil {
			return agent.Instance{}, err
		}
		if m.ProxyID != spec.ProxyID {
			return agent.Instance{}, agent.Wrapf(agent.ErrPermanent, "domain %s belongs to proxy %q, not %q", spec.Name, m.ProxyID, spec.ProxyID)
		}
		if err := d.start(ctx, dom); err != nil {
			return agent.Instance{}, err
		}
		return inst, nil
	}
	if !libvirt.IsNotFound(err) {
		return agent.Instance{}, err
	}

	base, err := d.images.Ensure(ctx, image.Source{Key: imgKey, URL: img.URL, SHA256: img.SHA256, Format: img.Format})
	if err != nil {
		return agent.Instance{}, err
	}
	pool, err := d.rpc.StoragePoolLookupByName(ctx, d.cfg.Pool)
	if err != nil {
		return agent.Instance{}, err
	}
	overlay, err := d.rpc.StorageVolLookupByName(ctx, pool, OverlayName(spec.Name))
	if libvirt.IsNotFound(err) {
		overlay, err = d.rpc.StorageVolCreateXML(ctx, pool, overlayVolumeXML(OverlayName(spec.Name), prof.DiskGiB, base.Path, base.Format))
	}
	if err != nil {
		return agent.Instance{}, fmt.Errorf("overlay: %w", err)
	}
	seed, err := d.writeSeed(ctx, pool, spec)
	if err != nil {
		return agent.Instance{}, err
	}
	diskPath, err := d.rpc.StorageVolGetPath(ctx, overlay)
	if err != nil {
		return agent.Instance{}, err
	}
	seedPath, err := d.rpc.StorageVolGetPath(ctx, seed)
	if err != nil {
		return agent.Instance{}, err
	}
	xml := domainXML(domainParams{
		Name: spec.Name, Type: d.cfg.DomainType, Marker: spec.Marker(), Image: imgKey, Port: spec.Port,
		VCPUs: prof.VCPUs, MemoryMiB: prof.MemoryMiB, UEFI: img.Firmware == "uefi",
		DiskPath: diskPath, DiskFormat: "qcow2", SeedPath: seedPath, SerialLog: d.serialLog(spec.Name),
		Network: d.cfg.Network, Bridge: d.cfg.Bridge, VLAN: d.cfg.VLAN, MAC: macFor(spec.Name),
	})
	dom, err = d.rpc.DomainDefineXML(ctx, xml)
	if err != nil {
		return agent.Instance{}, fmt.Errorf("define %s: %w", spec.Name, err)
	}
	if err := d.start(ctx, dom); err != nil {
		return agent.Instance{}, err
	}
	return inst, nil
}

// serialLog is the file the domain's serial console is logged to, or ""
// when serialLogDir is not configured.
func (d *Driver) serialLog(name string) string {
	if d.cfg.SerialLogDir == "" {
		return ""
	}
	return path.Join(d.cfg.SerialLogDir, name+".log")
}

// writeSeed rebuilds the seed ISO volume. It is rebuilt on every create: a
// cancelled upload may have left a truncated one.
func (d *Driver) writeSeed(ctx context.Context, pool libvirt.StoragePool, spec agent.Spec) (libvirt.StorageVol, error) {
	userData := spec.UserData
	if len(userData) == 0 {
		var err error
		if userData, err = cloudinit.DefaultSquidUserData(spec.Port, spec.Auth, spec.Egress); err != nil {
			return libvirt.StorageVol{}, agent.Wrapf(agent.ErrPermanent, "pool %s: %w", spec.Pool, err)
		}
	}
	iso, err := cloudinit.BuildISO(cloudinit.Seed{
		InstanceID: spec.Name, Hostname: spec.Name, UserData: userData,
		VendorData: []byte(d.cfg.VendorData), InstallGuestAgent: d.cfg.GuestAgent(),
	})
	if err != nil {
		return libvirt.StorageVol{}, agent.Wrap(agent.ErrTransient, fmt.Errorf("seed: %w", err))
	}
	name := SeedName(spec.Name)
	if err := d.removeVolume(ctx, pool, name); err != nil {
		return libvirt.StorageVol{}, fmt.Errorf("seed: %w", err)
	}
	vol, err := d.rpc.StorageVolCreateXML(ctx, pool, seedVolumeXML(name, uint64(len(iso))))
	if err != nil {
		return libvirt.StorageVol{}, fmt.Errorf("seed: %w", err)
	}
	if err := d.rpc.StorageVolUpload(ctx, vol, strings.NewReader(string(iso)), uint64(len(iso))); err != nil {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		_ = d.rpc.StorageVolDelete(dctx, vol)
		return libvirt.StorageVol{}, fmt.Errorf("seed: %w", err)
	}
	return vol, nil
}

// start starts dom unless it already runs.
func (d *Driver) start(ctx context.Context, dom libvirt.Domain) error {
	st, err := d.rpc.DomainGetState(ctx, dom)
	if err != nil {
		return err
	}
	if st == libvirt.DomainRunning || st == libvirt.DomainBlocked || st == libvirt.DomainPaused {
		return nil
	}
	if err := d.rpc.DomainCreate(ctx, dom); err != nil && !libvirt.HasCode(err, golibvirt.ErrOperationInvalid) {
		return fmt.Errorf("start %s: %w", dom.Name, err)
	}
	return nil
}

// marker reads the domain's marker; a domain without one is not ours.
func (d *Driver) marker(ctx context.Context, dom libvirt.Domain) (marker, error) {
	md, err := d.rpc.DomainGetMetadata(ctx, dom, MetadataURI)
	if libvirt.HasCode(err, golibvirt.ErrNoDomainMetadata) {
		return marker{}, agent.Wrapf(agent.ErrPermanent, "domain %s exists without the proxyfleet marker; it is not touched", dom.Name)
	}
	if err != nil {
		return marker{}, err
	}
	m, err := parseMarker(md)
	if err != nil {
		return marker{}, agent.Wrap(agent.ErrPermanent, fmt.Errorf("domain %s: %w", dom.Name, err))
	}
	return m, nil
}

// Get observes the domain of ref.
func (d *Driver) Get(ctx context.Context, ref agent.Ref) (agent.Instance, error) {
	dom, err := d.rpc.DomainLookupByName(ctx, ref.Name)
	if err != nil {
		return agent.Instance{}, err
	}
	m, err := d.marker(ctx, dom)
	if err != nil {
		return agent.Instance{}, err
	}
	inst := agent.Instance{Name: ref.Name, ProviderID: d.providerID(ref.Name), Marker: m.agentMarker()}
	st, err := d.rpc.DomainGetState(ctx, dom)
	if err != nil {
		return agent.Instance{}, err
	}
	switch st {
	case libvirt.DomainRunning, libvirt.DomainBlocked:
	case libvirt.DomainShutoff, libvirt.DomainCrashed, libvirt.DomainShutdown:
		inst.State = agent.StateTerminated
		inst.Detail = "domain " + stateName(st)
		return inst, nil
	default:
		inst.State = agent.StateProvisioning
		inst.Detail = "domain " + stateName(st)
		return inst, nil
	}
	ip, err := d.address(ctx, dom, macFor(ref.Name))
	if err != nil {
		return agent.Instance{}, err
	}
	if ip == "" {
		inst.State = agent.StateProvisioning
		inst.Detail = "no address yet"
		return inst, nil
	}
	inst.State = agent.StateRunning
	inst.Address = net.JoinHostPort(ip, strconv.Itoa(m.Port))
	return inst, nil
}

// address asks the guest agent, then the DHCP lease, then the ARP table.
// One source failing means "no address yet" (while a guest boots, its agent
// is not up); every source failing, or a dead connection, is transient.
func (d *Driver) address(ctx context.Context, dom libvirt.Domain, mac string) (string, error) {
	var errs []error
	for _, src := range []uint32{libvirt.SourceAgent, libvirt.SourceLease, libvirt.SourceARP} {
		ifs, err := d.rpc.DomainInterfaceAddresses(ctx, dom, src)
		if err != nil {
			var le *libvirt.Error
			if !errors.As(err, &le) || ctx.Err() != nil {
				return "", agent.Wrap(agent.ErrTransient, fmt.Errorf("address of %s: %w", dom.Name, err))
			}
			errs = append(errs, err)
			continue
		}
		if ip := pickIPv4(ifs, mac); ip != "" {
			return ip, nil
		}
	}
	if len(errs) == 3 {
		// The explicit class matters: without it the first libvirt code
		// (often a permanent one) would latch a running proxy as failed.
		return "", agent.Wrap(agent.ErrTransient, fmt.Errorf("address of %s: every source failed: %w", dom.Name, errors.Join(errs...)))
	}
	return "", nil
}

// pickIPv4 returns the first routable IPv4 address, preferring the
// interface with mac.
func pickIPv4(ifs []libvirt.DomainInterface, mac string) string {
	var fallback string
	for _, i := range ifs {
		for _, a := range i.Addrs {
			ip := net.ParseIP(a.Addr)
			if ip == nil || ip.To4() == nil || ip.IsLoopback() || ip.IsLinkLocalUnicast() || ip.IsUnspecified() {
				continue
			}
			if len(i.Hwaddr) > 0 && strings.EqualFold(i.Hwaddr[0], mac) {
				return ip.String()
			}
			if fallback == "" {
				fallback = ip.String()
			}
		}
	}
	return fallback
}

// Delete destroys and undefines the domain (with its NVRAM) and removes its
// volumes. Anything already gone is fine; a domain without our marker is
// refused.
func (d *Driver) Delete(ctx context.Context, ref agent.Ref) error {
	dom, err := d.rpc.DomainLookupByName(ctx, ref.Name)
	switch {
	case err == nil:
		if _, err := d.marker(ctx, dom); err != nil {
			return err
		}
		if err := d.rpc.DomainDestroy(ctx, dom); err != nil && !libvirt.HasCode(err, golibvirt.ErrOperationInvalid) && !libvirt.IsNotFound(err) {
			return fmt.Errorf("destroy %s: %w", ref.Name, err)
		}
		if err := d.rpc.DomainUndefineFlags(ctx, dom); err != nil && !libvirt.IsNotFound(err) {
			return fmt.Errorf("undefine %s: %w", ref.Name, err)
		}
	case libvirt.IsNotFound(err):
	default:
		return err
	}
	pool, err := d.rpc.StoragePoolLookupByName(ctx, d.cfg.Pool)
	if libvirt.HasCode(err, golibvirt.ErrNoStoragePool) {
		return nil // no pool, no volumes
	}
	if err != nil {
		return err
	}
	for _, name := range []string{OverlayName(ref.Name), SeedName(ref.Name)} {
		if err := d.removeVolume(ctx, pool, name); err != nil {
			return fmt.Errorf("remove volume %s: %w", name, err)
		}
	}
	return nil
}

func (d *Driver) removeVolume(ctx context.Context, pool libvirt.StoragePool, name string) error {
	vol, err := d.rpc.StorageVolLookupByName(ctx, pool, name)
	if libvirt.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if err := d.rpc.StorageVolDelete(ctx, vol); err != nil && !libvirt.IsNotFound(err) {
		return err
	}
	return nil
}

// stateName names a virDomainState as virsh does.
func stateName(st int32) string {
	switch st {
	case libvirt.DomainRunning:
		return "running"
	case libvirt.DomainBlocked:
		return "blocked"
	case libvirt.DomainPaused:
		return "paused"
	case libvirt.DomainShutdown:
		return "shutting down"
	case libvirt.DomainShutoff:
		return "shut off"
	case libvirt.DomainCrashed:
		return "crashed"
	case libvirt.DomainPmsuspended:
		return "suspended by guest power management"
	}
	return fmt.Sprintf("in state %d", st)
}

// List returns the domains carrying this entry's marker, without state or
// address lookups: one virConnectListAllDomains plus one metadata read per
// domain. The listing carries each domain's id, which libvirt sets to -1
// for an inactive domain, so a shut-off domain (also one that crashed:
// domains are defined with on_crash=destroy) is reported terminated at no
// extra cost. An active domain's State is left empty: telling running from
// booting needs Get's state and address calls.
func (d *Driver) List(ctx context.Context) ([]agent.Instance, error) {
	doms, err := d.rpc.ConnectListAllDomains(ctx)
	if err != nil {
		return nil, err
	}
	var out []agent.Instance
	for _, dom := range doms {
		md, err := d.rpc.DomainGetMetadata(ctx, dom, MetadataURI)
		if libvirt.IsNotFound(err) {
			continue // unmarked, or gone since the listing
		}
		if err != nil {
			var le *libvirt.Error
			if !errors.As(err, &le) {
				return nil, err // the connection failed: the list would be partial
			}
			d.log.Warn("skipping a domain whose metadata cannot be read", "domain", dom.Name, "err", err)
			continue
		}
		m, err := parseMarker(md)
		if err != nil || m.Entry != d.cfg.Entry {
			continue
		}
		inst := agent.Instance{Name: dom.Name, ProviderID: d.providerID(dom.Name), Marker: m.agentMarker()}
		if dom.ID < 0 {
			inst.State, inst.Detail = agent.StateTerminated, "domain shut off"
		}
		out = append(out, inst)
	}
	return out, nil
}

// Check reports libvirtd's version, the host name, whether the pool runs and
// its free space. Its calls abandon on timeout instead of dropping the
// connection other work shares.
func (d *Driver) Check(ctx context.Context) []agent.Verdict {
	var out []agent.Verdict
	v, err := d.probe.ConnectGetLibVersion(ctx)
	if err != nil {
		return append(out, agent.Verdict{Check: "libvirt", OK: false, Detail: err.Error()})
	}
	out = append(out, agent.Verdict{Check: "libvirt", OK: true, Detail: fmt.Sprintf("libvirt %d.%d.%d", v/1000000, v/1000%1000, v%1000)})
	host, err := d.probe.ConnectGetHostname(ctx)
	out = append(out, verdict("hostname", host, err))
	pool, err := d.probe.StoragePoolLookupByName(ctx, d.cfg.Pool)
	if err != nil {
		return append(out, agent.Verdict{Check: "pool", OK: false, Detail: err.Error()})
	}
	state, avail, err := d.probe.StoragePoolGetInfo(ctx, pool)
	if err != nil {
		return append(out, agent.Verdict{Check: "pool", OK: false, Detail: err.Error()})
	}
	out = append(out, agent.Verdict{Check: "pool", OK: state == libvirt.PoolRunning, Detail: fmt.Sprintf("pool %s state %d", d.cfg.Pool, state)})
	const minFree = 1 << 30
	out = append(out, agent.Verdict{Check: "space", OK: avail >= minFree, Detail: fmt.Sprintf("%.1f GiB free in pool %s", float64(avail)/(1<<30), d.cfg.Pool)})
	return out
}

func verdict(check, detail string, err error) agent.Verdict {
	if err != nil {
		return agent.Verdict{Check: check, OK: false, Detail: err.Error()}
	}
	return agent.Verdict{Check: check, OK: true, Detail: detail}
}
