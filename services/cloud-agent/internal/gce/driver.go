package gce

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"google.golang.org/api/compute/v1"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/services/cloud-agent/internal/config"
)

// Marker labels. Label keys and values allow lowercase letters, digits, '-'
// and '_' up to 63 characters: identifiers fit as they are.
const (
	LabelProxy = "proxyfleet-proxy"
	LabelPool  = "proxyfleet-pool"
	LabelEntry = "proxyfleet-entry"
	LabelPort  = "proxyfleet-port"
)

// MetadataUserData is the metadata key cloud-init reads user-data from.
const MetadataUserData = "user-data"

// Options configure a [Driver].
type Options struct {
	Entry string
	// Zone is this driver's target.
	Zone string
	// Zones are all targets of the entry. The driver of Zones[0] also
	// reports marked instances found in zones that are no target (left from
	// an earlier config), so garbage collection still reaches them.
	Zones  []string
	Config config.GCE
	// DefaultUserData builds the cloud-config used when a pool gives none.
	DefaultUserData func(port int, auth *events.ProxyAuth, pol egress.Policy) ([]byte, error)
	Log             *slog.Logger
}

// Driver is the GCE [agent.Driver] for one zone.
type Driver struct {
	svc  *compute.Service
	o    Options
	log  *slog.Logger
	mu   sync.Mutex
	miss []string // zones the last inventory could not reach
}

var _ agent.Driver = (*Driver)(nil)

// New returns a driver on svc (see [NewService]).
func New(svc *compute.Service, o Options) *Driver {
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if len(o.Zones) == 0 {
		o.Zones = []string{o.Zone}
	}
	return &Driver{svc: svc, o: o, log: o.Log.With("zone", o.Zone)}
}

// ProviderID returns the zone-qualified provider ID of an instance:
// "projects/<project>/zones/<zone>/instances/<name>".
func ProviderID(project, zone, name string) string {
	return "projects/" + project + "/zones/" + zone + "/instances/" + name
}

// parseProviderID splits a provider ID made by [ProviderID].
func parseProviderID(id string) (project, zone, name string, err error) {
	p := strings.Split(id, "/")
	if len(p) != 6 || p[0] != "projects" || p[2] != "zones" || p[4] != "instances" || p[1] == "" || p[3] == "" || p[5] == "" {
		return "", "", "", agent.Wrapf(agent.ErrPermanent, "provider ID %q is not projects/<project>/zones/<zone>/instances/<name>", id)
	}
	return p[1], p[3], p[5], nil
}

// RequestID returns the deterministic requestId of one operation, in UUID
// form as the API demands: a retried insert or delete with the same key is
// answered with the first call's operation instead of running twice.
func RequestID(parts ...string) string {
	sum := sha256.Sum256([]byte("proxyfleet/" + strings.Join(parts, "/")))
	b := sum[:16]
	b[6] = b[6]&0x0f | 0x50 // version 5 layout (name based)
	b[8] = b[8]&0x3f | 0x80 // RFC 4122 variant
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// Create inserts the instance behind spec and waits for the insert to
// finish. It returns the instance as found after the insert; its address
// may come later (see [Driver.Get]).
func (d *Driver) Create(ctx context.Context, spec agent.Spec) (agent.Instance, error) {
	for field, v := range map[string]string{"proxy": spec.ProxyID, "pool": spec.Pool, "entry": spec.Entry} {
		if !events.IsIdentifier(v) {
			return agent.Instance{}, agent.Wrapf(agent.ErrPermanent, "%s %q cannot be a GCE label value", field, v)
		}
	}
	inst, err := d.instanceFor(spec)
	if err != nil {
		return agent.Instance{}, err
	}
	zone := d.o.Zone
	log := d.log.With("proxy", spec.ProxyID, "instance", spec.Name)
	op, err := d.svc.Instances.Insert(d.o.Config.Project, zone, inst).
		RequestId(RequestID(spec.ProxyID, "insert", strconv.Itoa(spec.Attempt))).Context(ctx).Do()
	if err == nil {
		err = d.wait(ctx, zone, op)
	} else {
		err = classify(err)
	}
	if errors.Is(err, errAlreadyExists) {
		log.Info("instance exists; adopting it if it carries this proxy's marker")
		return d.adopt(ctx, zone, spec)
	}
	if err != nil {
		return agent.Instance{}, fmt.Errorf("insert %s in %s: %w", spec.Name, zone, err)
	}
	got, err := d.get(ctx, zone, spec.Name)
	if errors.Is(err, agent.ErrNotFound) {
		// Seen after a stockout: the insert finished, the instance vanished.
		return agent.Instance{}, agent.Wrapf(agent.ErrTransient, "instance %s vanished after its insert finished", spec.Name)
	}
	return got, err
}

// adopt accepts an existing instance of the same name only when it carries
// the marker of spec's proxy.
func (d *Driver) adopt(ctx context.Context, zone string, spec agent.Spec) (agent.Instance, error) {
	got, err := d.get(ctx, zone, spec.Name)
	if err != nil {
		return agent.Instance{}, fmt.Errorf("instance %s exists but cannot be read: %w", spec.Name, err)
	}
	if got.Marker != spec.Marker() {
		return agent.Instance{}, agent.Wrapf(agent.ErrPermanent,
			"instance %s in %s exists without the marker of proxy %s (labels say %+v); it is left alone", spec.Name, zone, spec.ProxyID, got.Marker)
	}
	return got, nil
}

func (d *Driver) instanceFor(spec agent.Spec) (*compute.Instance, error) {
	c := d.o.Config
	image, err := agent.Lookup(d.o.Entry, "image", c.Images, spec.Image, c.DefaultImage)
	if err != nil {
		return nil, err
	}
	machineType, err := agent.Lookup(d.o.Entry, "profile", c.Profiles, spec.Profile, c.DefaultProfile)
	if err != nil {
		return nil, err
	}
	userData := spec.UserData
	if len(userData) == 0 {
		if d.o.DefaultUserData == nil {
			return nil, agent.Wrapf(agent.ErrPermanent, "pool %s gives no user-data and no default cloud-config is configured", spec.Pool)
		}
		var err error
		if userData, err = d.o.DefaultUserData(spec.Port, spec.Auth, spec.Egress); err != nil {
			return nil, agent.Wrapf(agent.ErrPermanent, "pool %s: %w", spec.Pool, err)
		}
	}
	ud := string(userData)
	nic := &compute.NetworkInterface{Network: c.Network, Subnetwork: c.Subnetwork}
	if c.ExternalIP {
		nic.AccessConfigs = []*compute.AccessConfig{{Name: "external-nat", Type: "ONE_TO_ONE_NAT"}}
	}
	inst := &compute.Instance{
		Name:        spec.Name,
		Description: "proxyfleet proxy " + spec.ProxyID + " of pool " + spec.Pool,
		MachineType: "zones/" + d.o.Zone + "/machineTypes/" + machineType,
		Labels: map[string]string{
			LabelProxy: spec.ProxyID, LabelPool: spec.Pool, LabelEntry: spec.Entry, LabelPort: strconv.Itoa(spec.Port),
		},
		Disks: []*compute.AttachedDisk{{
			Boot: true, AutoDelete: true, Type: "PERSISTENT",
			InitializeParams: &compute.AttachedDiskInitializeParams{SourceImage: image, DiskSizeGb: c.DiskSizeGB},
		}},
		NetworkInterfaces: []*compute.NetworkInterface{nic},
		Metadata:          &compute.Metadata{Items: []*compute.MetadataItems{{Key: MetadataUserData, Value: &ud}}},
	}
	if len(c.Tags) > 0 {
		inst.Tags = &compute.Tags{Items: c.Tags}
	}
	if c.Preemptible {
		inst.Scheduling = &compute.Scheduling{Preemptible: true, AutomaticRestart: new(false)}
	}
	return inst, nil
}

// wait polls a zone operation until it is DONE and returns its own error,
// classified. zoneOperations.wait returns when the operation is done or
// near its own deadline, so a RUNNING answer just means "ask again".
func (d *Driver) wait(ctx context.Context, zone string, op *compute.Operation) error {
	for op.Status != "DONE" {
		if err := ctx.Err(); err != nil {
			return agent.Wrapf(agent.ErrTransient, "operation %s still %s: %w", op.Name, op.Status, err)
		}
		next, err := d.svc.ZoneOperations.Wait(d.o.Config.Project, zone, op.Name).Context(ctx).Do()
		if err != nil {
			return fmt.Errorf("wait for operation %s: %w", op.Name, classify(err))
		}
		op = next
	}
	return operationError(op)
}

// Get reads one instance.
func (d *Driver) Get(ctx context.Context, ref agent.Ref) (agent.Instance, error) {
	zone, name, err := d.locate(ref)
	if err != nil {
		return agent.Instance{}, err
	}
	return d.get(ctx, zone, name)
}

func (d *Driver) get(ctx context.Context, zone, name string) (agent.Instance, error) {
	inst, err := d.svc.Instances.Get(d.o.Config.Project, zone, name).Context(ctx).Do()
	if err != nil {
		return agent.Instance{}, fmt.Errorf("get %s in %s: %w", name, zone, classify(err))
	}
	return d.toInstance(inst), nil
}

// locate returns the zone and name a reference points at.
func (d *Driver) locate(ref agent.Ref) (zone, name string, err error) {
	if ref.ProviderID == "" {
		if ref.Name == "" {
			return "", "", agent.Wrapf(agent.ErrPermanent, "reference to proxy %s has neither a provider ID nor a name", ref.ProxyID)
		}
		return d.o.Zone, ref.Name, nil
	}
	project, zone, name, err := parseProviderID(ref.ProviderID)
	if err != nil {
		return "", "", err
	}
	if project != d.o.Config.Project {
		return "", "", agent.Wrapf(agent.ErrPermanent, "provider ID %s belongs to project %s, not %s", ref.ProviderID, project, d.o.Config.Project)
	}
	return zone, name, nil
}

// Delete removes the instance after checking it carries the marker of
// ref's proxy and of this entry. An instance already gone is
// [agent.ErrNotFound].
func (d *Driver) Delete(ctx context.Context, ref agent.Ref) error {
	zone, name, err := d.locate(ref)
	if err != nil {
		return err
	}
	inst, err := d.svc.Instances.Get(d.o.Config.Project, zone, name).Context(ctx).Do()
	if err != nil {
		return fmt.Errorf("get %s in %s before delete: %w", name, zone, classify(err))
	}
	m := markerOf(inst.Labels)
	if m.Entry != d.o.Entry || (ref.ProxyID != "" && m.ProxyID != ref.ProxyID) {
		return agent.Wrapf(agent.ErrPermanent, "instance %s in %s does not carry the marker of proxy %s in entry %s (labels say %+v); it is left alone", name, zone, ref.ProxyID, d.o.Entry, m)
	}
	op, err := d.svc.Instances.Delete(d.o.Config.Project, zone, name).
		RequestId(RequestID(name, "delete", strconv.FormatUint(inst.Id, 10))).Context(ctx).Do()
	if err == nil {
		err = d.wait(ctx, zone, op)
	} else {
		err = classify(err)
	}
	if err != nil {
		return fmt.Errorf("delete %s in %s: %w", name, zone, err)
	}
	d.log.Info("instance deleted", "instance", name, "proxy", m.ProxyID)
	return nil
}

// entryFilter is the aggregatedList filter for this entry's marked instances.
func (d *Driver) entryFilter() string {
	return fmt.Sprintf("labels.%s = %q", LabelEntry, d.o.Entry)
}

// List returns the marked instances of this entry in this zone (and, for the
// entry's first zone, in zones that are no target), from one aggregatedList
// over every page. Zones the API reports unreachable are logged; when this
// driver's own zone is among them the list is incomplete and List fails.
func (d *Driver) List(ctx context.Context) ([]agent.Instance, error) {
	var out []agent.Instance
	unreachable := map[string]bool{}
	err := d.svc.Instances.AggregatedList(d.o.Config.Project).
		Filter(d.entryFilter()).Context(ctx).
		Pages(ctx, func(page *compute.InstanceAggregatedList) error {
			for _, u := range page.Unreachables {
				unreachable[lastSegment(u)] = true
			}
			for scope, list := range page.Items {
				zone := strings.TrimPrefix(scope, "zones/")
				if list.Warning != nil && list.Warning.Code == "UNREACHABLE" {
					unreachable[zone] = true
				}
				for _, inst := range list.Instances {
					z := lastSegment(inst.Zone)
					if z == "" {
						z = zone
					}
					if !d.owns(z) || inst.Labels[LabelProxy] == "" || inst.Labels[LabelEntry] != d.o.Entry {
						continue
					}
					out = append(out, d.toInstance(inst))
				}
			}
			return nil
		})
	if err != nil {
		return nil, fmt.Errorf("aggregated list of instances: %w", classify(err))
	}
	miss := slices.Sorted(maps.Keys(unreachable))
	d.mu.Lock()
	d.miss = miss
	d.mu.Unlock()
	if len(miss) > 0 {
		d.log.Warn("inventory: zones unreachable", "zones", strings.Join(miss, ","))
		if unreachable[d.o.Zone] {
			return out, agent.Wrapf(agent.ErrTransient, "inventory incomplete: zone %s unreachable", d.o.Zone)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// owns reports whether this driver reports instances found in zone.
func (d *Driver) owns(zone string) bool {
	return zone == d.o.Zone || (d.o.Zone == d.o.Zones[0] && !slices.Contains(d.o.Zones, zone))
}

// Check lists one page of at most one marked instance in the zone: it proves
// credentials, project, zone and the list permission in one cheap call.
func (d *Driver) Check(ctx context.Context) []agent.Verdict {
	_, err := d.svc.Instances.List(d.o.Config.Project, d.o.Zone).
		Filter(d.entryFilter()).MaxResults(1).Context(ctx).Do()
	v := []agent.Verdict{{Check: "compute-api", OK: err == nil}}
	if err != nil {
		v[0].Detail = classify(err).Error()
	} else {
		v[0].Detail = "project " + d.o.Config.Project + ", zone " + d.o.Zone
	}
	d.mu.Lock()
	miss := d.miss
	d.mu.Unlock()
	inv := agent.Verdict{Check: "inventory-zones", OK: len(miss) == 0}
	if len(miss) > 0 {
		inv.Detail = "unreachable in the last inventory: " + strings.Join(miss, ", ")
	}
	return append(v, inv)
}

func markerOf(labels map[string]string) agent.Marker {
	return agent.Marker{ProxyID: labels[LabelProxy], Pool: labels[LabelPool], Entry: labels[LabelEntry]}
}

// toInstance maps a Compute instance to the agent's view of it.
func (d *Driver) toInstance(inst *compute.Instance) agent.Instance {
	zone := lastSegment(inst.Zone)
	if zone == "" {
		zone = d.o.Zone
	}
	out := agent.Instance{
		Name:       inst.Name,
		ProviderID: ProviderID(d.o.Config.Project, zone, inst.Name),
		Marker:     markerOf(inst.Labels),
		Detail:     inst.Status,
	}
	switch inst.Status {
	case "RUNNING":
		ip := d.address(inst)
		port := inst.Labels[LabelPort]
		if ip == "" || port == "" {
			out.State = agent.StateProvisioning
			out.Detail = "RUNNING without an address yet"
			break
		}
		out.State = agent.StateRunning
		out.Address = ip + ":" + port
	case "STOPPING", "STOPPED", "SUSPENDING", "SUSPENDED", "TERMINATED":
		// Stopped, suspended or preempted: nothing here starts a proxy's
		// instance again, so it is dead for the fleet.
		out.State = agent.StateTerminated
		out.Detail = "instance is " + inst.Status
		if inst.StatusMessage != "" {
			out.Detail += ": " + inst.StatusMessage
		}
	default: // PROVISIONING, STAGING, REPAIRING, PENDING_STOP
		out.State = agent.StateProvisioning
	}
	return out
}

func (d *Driver) address(inst *compute.Instance) string {
	if len(inst.NetworkInterfaces) == 0 {
		return ""
	}
	nic := inst.NetworkInterfaces[0]
	if d.o.Config.ExternalIP {
		for _, ac := range nic.AccessConfigs {
			if ac.NatIP != "" {
				return ac.NatIP
			}
		}
		return ""
	}
	return nic.NetworkIP
}
