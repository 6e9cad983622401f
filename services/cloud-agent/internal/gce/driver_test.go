package gce

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/api/compute/v1"
	"google.golang.org/api/googleapi"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/cloud-agent/internal/config"
)

func testConfig() config.GCE {
	return config.GCE{
		Project:      "proj-1",
		Images:       map[string]string{"debian-12": "projects/debian-cloud/global/images/family/debian-12"},
		DefaultImage: "debian-12",
		Profiles:     map[string]string{"small": "e2-small"}, DefaultProfile: "small",
		Network: "global/networks/default", Tags: []string{"proxyfleet-proxy"}, ExternalIP: true,
	}
}

func defaultUserData(port int, auth *events.ProxyAuth, pol egress.Policy) ([]byte, error) {
	if auth != nil && auth.Password == "unhashable" {
		return nil, errors.New("default cloud-config: basic auth: refused")
	}
	return fmt.Appendf(nil, "#cloud-config\n# squid on %d, egress ports %v\n", port, pol.AllowPorts), nil
}

func newDriver(t testing.TB, f *fakeCompute, zone string, zones []string, log *slog.Logger) *Driver {
	t.Helper()
	svc, err := NewService(context.Background(), ServiceOptions{Endpoint: f.base(), NoAuth: true}, log)
	if err != nil {
		t.Fatal(err)
	}
	return New(svc, Options{Entry: "gce-eu", Zone: zone, Zones: zones, Config: testConfig(), DefaultUserData: defaultUserData, Log: log})
}

func spec(id string, attempt int) agent.Spec {
	return agent.Spec{ProxyID: id, Pool: "pool-a", Entry: "gce-eu", Target: "zone-a", Name: events.InstanceName(id),
		Attempt: attempt, Port: 3128, UserData: []byte("#cloud-config\nruncmd: [echo hi]\n")}
}

func ctx(t testing.TB) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

// waitRunning polls Get as the agent runtime does.
func waitRunning(t *testing.T, d *Driver, ref agent.Ref) agent.Instance {
	t.Helper()
	var inst agent.Instance
	testwait.Until(t, 10*time.Second, ref.Name+" to reach running", func() bool {
		var err error
		if inst, err = d.Get(ctx(t), ref); err != nil {
			t.Fatalf("get: %v", err)
		}
		return inst.State == agent.StateRunning
	})
	return inst
}

// createRunning creates s with d and waits until it runs, as the agent
// runtime would; it returns the instance's reference.
func createRunning(t *testing.T, d *Driver, s agent.Spec) agent.Ref {
	t.Helper()
	inst, err := d.Create(ctx(t), s)
	if err != nil {
		t.Fatal(err)
	}
	ref := agent.Ref{ProxyID: s.ProxyID, Name: s.Name, ProviderID: inst.ProviderID}
	waitRunning(t, d, ref)
	return ref
}

func TestCreateWaitsForOperationThenReportsAddress(t *testing.T) {
	f := newFakeCompute(t, "zone-a")
	f.pollsToDone = 3
	d := newDriver(t, f, "zone-a", nil, nil)
	s := spec("px-one", 1)
	inst, err := d.Create(ctx(t), s)
	if err != nil {
		t.Fatal(err)
	}
	if inst.State != agent.StateProvisioning || inst.Marker != s.Marker() {
		t.Fatalf("after create: %+v, want provisioning with marker %+v", inst, s.Marker())
	}
	if want := "projects/proj-1/zones/zone-a/instances/" + s.Name; inst.ProviderID != want {
		t.Fatalf("provider ID = %q, want %q", inst.ProviderID, want)
	}
	waits := 0
	for _, r := range f.recorded() {
		if strings.HasSuffix(r.Path, "/wait") {
			waits++
		}
	}
	if waits != 3 {
		t.Fatalf("wait calls = %d, want 3 (RUNNING, RUNNING, DONE)", waits)
	}
	got := f.instance("zone-a", s.Name)
	if got.Labels[LabelProxy] != "px-one" || got.Labels[LabelPool] != "pool-a" || got.Labels[LabelEntry] != "gce-eu" {
		t.Fatalf("labels = %v", got.Labels)
	}
	if got.Metadata.Items[0].Key != MetadataUserData || *got.Metadata.Items[0].Value != string(s.UserData) {
		t.Fatalf("metadata = %+v, want the pool's user-data", got.Metadata.Items[0])
	}
	if !strings.HasSuffix(got.MachineType, "zones/zone-a/machineTypes/e2-small") || got.Tags.Items[0] != "proxyfleet-proxy" ||
		got.Disks[0].InitializeParams.SourceImage != testConfig().Images["debian-12"] || got.NetworkInterfaces[0].AccessConfigs[0].Type != "ONE_TO_ONE_NAT" {
		t.Fatalf("instance body = %+v", got)
	}
	run := waitRunning(t, d, agent.Ref{ProxyID: s.ProxyID, Name: s.Name, ProviderID: inst.ProviderID})
	if !strings.HasPrefix(run.Address, "203.0.113.") || !strings.HasSuffix(run.Address, ":3128") {
		t.Fatalf("address = %q, want the external NAT address with port 3128", run.Address)
	}
}

func TestCreateUsesDefaultUserDataWhenPoolGivesNone(t *testing.T) {
	f := newFakeCompute(t, "zone-a")
	d := newDriver(t, f, "zone-a", nil, nil)
	s := spec("px-default", 1)
	s.UserData, s.Port = nil, 8080
	s.Egress = egress.Policy{AllowPorts: []uint16{8443}}
	if _, err := d.Create(ctx(t), s); err != nil {
		t.Fatal(err)
	}
	want, _ := defaultUserData(8080, nil, s.Egress)
	if got := *f.instance("zone-a", s.Name).Metadata.Items[0].Value; got != string(want) {
		t.Fatalf("user-data = %q, want the default cloud-config with the spec's egress policy", got)
	}
	// A default the pool's auth cannot be rendered into fails for good.
	s = spec("px-default-bad", 1)
	s.UserData, s.Auth = nil, &events.ProxyAuth{Username: "crawler", Password: "unhashable"}
	if _, err := d.Create(ctx(t), s); !errors.Is(err, agent.ErrPermanent) || !strings.Contains(err.Error(), "basic auth") {
		t.Fatalf("create with an unrenderable default: %v, want ErrPermanent naming basic auth", err)
	}
}

// TestCreateInsertsOnce: a repeated create inserts once (the conformance
// suite's CreateIsIdempotent checks what it returns).
func TestCreateInsertsOnce(t *testing.T) {
	f := newFakeCompute(t, "zone-a")
	d := newDriver(t, f, "zone-a", nil, nil)
	s := spec("px-idem", 1)
	if _, err := d.Create(ctx(t), s); err != nil {
		t.Fatal(err)
	}
	// Same attempt: the same requestId is answered with the first operation.
	if _, err := d.Create(ctx(t), s); err != nil {
		t.Fatal(err)
	}
	// A later attempt: a new requestId, the name exists, the marker matches.
	s.Attempt = 2
	if _, err := d.Create(ctx(t), s); err != nil {
		t.Fatal(err)
	}
	if f.inserts != 1 || f.count() != 1 {
		t.Fatalf("inserts = %d, instances = %d; want 1 and 1", f.inserts, f.count())
	}
	if RequestID("px-idem", "insert", "1") == RequestID("px-idem", "insert", "2") {
		t.Fatal("request IDs of two attempts are equal")
	}
}

func TestCreateLeavesForeignInstanceAlone(t *testing.T) {
	f := newFakeCompute(t, "zone-a")
	d := newDriver(t, f, "zone-a", nil, nil)
	s := spec("px-foreign", 1)
	f.put("zone-a", &compute.Instance{Name: s.Name, Status: "RUNNING", Labels: map[string]string{"team": "web"}})
	_, err := d.Create(ctx(t), s)
	if !errors.Is(err, agent.ErrPermanent) {
		t.Fatalf("create over a foreign instance: %v, want ErrPermanent", err)
	}
	if err := d.Delete(ctx(t), agent.Ref{ProxyID: s.ProxyID, Name: s.Name}); !errors.Is(err, agent.ErrPermanent) {
		t.Fatalf("delete of a foreign instance: %v, want ErrPermanent", err)
	}
	if f.instance("zone-a", s.Name) == nil {
		t.Fatal("the foreign instance was deleted")
	}
}

func TestCreateErrorClasses(t *testing.T) {
	cases := []struct {
		name   string
		inject func(f *fakeCompute)
		want   error
	}{
		{"quota sync", func(f *fakeCompute) {
			f.failNext("POST", "insert", 403, "quotaExceeded", "Quota 'CPUS' exceeded.  Limit: 8.0 in region us-central1.")
		}, agent.ErrQuotaExceeded},
		{"quota in operation", func(f *fakeCompute) { f.failInsertOp("zone-a", codeQuotaExceeded) }, agent.ErrQuotaExceeded},
		{"stockout", func(f *fakeCompute) { f.failInsertOp("zone-a", codeStockout) }, agent.ErrQuotaExceeded},
		{"stockout with details", func(f *fakeCompute) { f.failInsertOp("zone-a", codeStockoutWithDetails) }, agent.ErrQuotaExceeded},
		{"rate limit", func(f *fakeCompute) {
			f.failNext("POST", "insert", 403, "rateLimitExceeded", "Rate Limit Exceeded")
		}, agent.ErrTransient},
		{"429", func(f *fakeCompute) { f.failNext("POST", "insert", 429, "rateLimitExceeded", "Too Many Requests") }, agent.ErrTransient},
		{"503", func(f *fakeCompute) { f.failNext("POST", "insert", 503, "backendError", "Backend Error") }, agent.ErrTransient},
		{"wait 500", func(f *fakeCompute) { f.failNext("POST", "wait", 500, "internalError", "Internal Error") }, agent.ErrTransient},
		{"forbidden", func(f *fakeCompute) {
			f.failNext("POST", "insert", 403, "forbidden", "Required 'compute.instances.create' permission")
		}, agent.ErrPermanent},
		{"bad image", func(f *fakeCompute) {
			f.failNext("POST", "insert", 400, "invalid", "Invalid value for field 'resource.disks[0].initializeParams.sourceImage'")
		}, agent.ErrPermanent},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFakeCompute(t, "zone-a")
			d := newDriver(t, f, "zone-a", nil, nil)
			c.inject(f)
			_, err := d.Create(ctx(t), spec("px-err", 1))
			if !errors.Is(err, c.want) {
				t.Fatalf("create: %v (class %s), want %v", err, agent.Classify(err), c.want)
			}
		})
	}
}

// TestStockoutInstanceAppearsThenVanishes drives the fake through the raw
// API, as the real API behaves on a stockout: the instance is visible while
// the insert runs; once the operation is DONE with its error, GET says 404.
func TestStockoutInstanceAppearsThenVanishes(t *testing.T) {
	f := newFakeCompute(t, "zone-a")
	f.failInsertOp("zone-a", codeStockout)
	d := newDriver(t, f, "zone-a", nil, nil)
	svc := d.svc
	inst, err := d.instanceFor(spec("px-stock", 1))
	if err != nil {
		t.Fatal(err)
	}
	op, err := svc.Instances.Insert("proj-1", "zone-a", inst).Context(ctx(t)).Do()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := svc.Instances.Get("proj-1", "zone-a", inst.Name).Context(ctx(t)).Do(); err != nil {
		t.Fatalf("instance not visible while the insert runs: %v", err)
	}
	err = d.wait(ctx(t), "zone-a", op)
	if !errors.Is(err, agent.ErrQuotaExceeded) {
		t.Fatalf("operation error: %v, want ErrQuotaExceeded", err)
	}
	_, err = svc.Instances.Get("proj-1", "zone-a", inst.Name).Context(ctx(t)).Do()
	if !errors.Is(classify(err), agent.ErrNotFound) {
		t.Fatalf("get after stockout: %v, want not found", err)
	}
}

func TestDelete(t *testing.T) {
	f := newFakeCompute(t, "zone-a")
	d := newDriver(t, f, "zone-a", nil, nil)
	s := spec("px-del", 1)
	inst, err := d.Create(ctx(t), s)
	if err != nil {
		t.Fatal(err)
	}
	ref := agent.Ref{ProxyID: s.ProxyID, Name: s.Name, ProviderID: inst.ProviderID}
	if err := d.Delete(ctx(t), agent.Ref{ProxyID: "px-other", Name: s.Name}); !errors.Is(err, agent.ErrPermanent) {
		t.Fatalf("delete with another proxy's id: %v, want ErrPermanent", err)
	}
	if err := d.Delete(ctx(t), ref); err != nil {
		t.Fatal(err)
	}
	if f.count() != 0 {
		t.Fatal("instance still there after delete")
	}
	if err := d.Delete(ctx(t), agent.Ref{ProviderID: "projects/other/zones/zone-a/instances/x"}); !errors.Is(err, agent.ErrPermanent) {
		t.Fatalf("delete in another project: %v, want ErrPermanent", err)
	}
}

func TestListAllPagesByLabelAndUnreachableZones(t *testing.T) {
	f := newFakeCompute(t, "zone-a", "zone-b", "zone-c", "zone-d", "zone-e")
	f.pageSize = 2
	mark := func(id, entry string) map[string]string {
		return map[string]string{LabelProxy: id, LabelPool: "p", LabelEntry: entry, LabelPort: "3128"}
	}
	for i := range 3 {
		f.put("zone-a", &compute.Instance{Name: fmt.Sprintf("px-a%d", i), Status: "RUNNING", Labels: mark(fmt.Sprintf("a%d", i), "gce-eu")})
	}
	f.put("zone-b", &compute.Instance{Name: "px-b0", Status: "STAGING", Labels: mark("b0", "gce-eu")})
	f.put("zone-b", &compute.Instance{Name: "px-other", Status: "RUNNING", Labels: mark("o0", "gce-us")})
	f.put("zone-b", &compute.Instance{Name: "web-1", Status: "RUNNING"})
	// zone-e is no longer a target, but holds an instance of the entry.
	f.put("zone-e", &compute.Instance{Name: "px-e0", Status: "RUNNING", Labels: mark("e0", "gce-eu")})
	f.setUnreachable("zone-d", true)
	zones := []string{"zone-a", "zone-b", "zone-c", "zone-d"}

	names := func(list []agent.Instance) string {
		var out []string
		for _, i := range list {
			out = append(out, i.Name)
		}
		return strings.Join(out, ",")
	}
	a := newDriver(t, f, "zone-a", zones, nil)
	got, err := a.List(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if n := names(got); n != "px-a0,px-a1,px-a2,px-e0" {
		t.Fatalf("zone-a inventory = %s, want px-a0,px-a1,px-a2,px-e0", n)
	}
	pages := 0
	for _, r := range f.recorded() {
		if strings.HasSuffix(r.Path, "aggregated/instances") {
			pages++
		}
	}
	if pages < 3 {
		t.Fatalf("aggregatedList pages = %d, want every page (3)", pages)
	}
	b := newDriver(t, f, "zone-b", zones, nil)
	got, err = b.List(ctx(t))
	if err != nil || names(got) != "px-b0" || got[0].State != agent.StateProvisioning {
		t.Fatalf("zone-b inventory = %+v, %v; want px-b0 provisioning", got, err)
	}
	v := a.Check(ctx(t))
	if len(v) != 2 || !v[0].OK || v[1].OK || !strings.Contains(v[1].Detail, "zone-d") {
		t.Fatalf("check after inventory = %+v, want compute-api ok and zone-d unreachable", v)
	}
	dd := newDriver(t, f, "zone-d", zones, nil)
	if _, err := dd.List(ctx(t)); !errors.Is(err, agent.ErrTransient) {
		t.Fatalf("inventory of an unreachable zone: %v, want ErrTransient", err)
	}
	if v := dd.Check(ctx(t)); v[0].OK {
		t.Fatalf("check of an unreachable zone = %+v, want not ok", v)
	}
}

func TestCheckListsOneItem(t *testing.T) {
	f := newFakeCompute(t, "zone-a")
	d := newDriver(t, f, "zone-a", nil, nil)
	v := d.Check(ctx(t))
	if !v[0].OK {
		t.Fatalf("check = %+v", v)
	}
	reqs := f.recorded()
	last := reqs[len(reqs)-1]
	if last.Method != "GET" || last.Path != "projects/proj-1/zones/zone-a/instances" || !strings.Contains(strings.Join(last.Query, ","), "maxResults") {
		t.Fatalf("check request = %+v, want a one-item instances.list", last)
	}
	f.failNext("GET", "list", 403, "forbidden", "Required 'compute.instances.list' permission for 'projects/proj-1'")
	if v := d.Check(ctx(t)); v[0].OK || !strings.Contains(v[0].Detail, "compute.instances.list") {
		t.Fatalf("check without permission = %+v", v)
	}
}

func TestClassify(t *testing.T) {
	api := func(code int, reason string) error {
		return &googleapi.Error{Code: code, Message: "m", Errors: []googleapi.ErrorItem{{Reason: reason, Message: "m"}}}
	}
	cases := []struct {
		name string
		err  error
		want error
	}{
		{"quotaExceeded", api(403, "quotaExceeded"), agent.ErrQuotaExceeded},
		{"notFound", api(404, "notFound"), agent.ErrNotFound},
		{"bare 404", &googleapi.Error{Code: 404}, agent.ErrNotFound},
		{"alreadyExists", api(409, "alreadyExists"), errAlreadyExists},
		{"rateLimitExceeded", api(403, "rateLimitExceeded"), agent.ErrTransient},
		{"userRateLimitExceeded", api(403, "userRateLimitExceeded"), agent.ErrTransient},
		{"429", &googleapi.Error{Code: 429}, agent.ErrTransient},
		{"500", &googleapi.Error{Code: 500}, agent.ErrTransient},
		{"503", api(503, "backendError"), agent.ErrTransient},
		{"403 forbidden", api(403, "forbidden"), agent.ErrPermanent},
		{"400 invalid", api(400, "invalid"), agent.ErrPermanent},
		{"deadline", context.DeadlineExceeded, agent.ErrTransient},
		{"network", errors.New("dial tcp: connection refused"), agent.ErrTransient},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := classify(c.err); !errors.Is(got, c.want) {
				t.Fatalf("classify(%v) = %v, want %v", c.err, got, c.want)
			}
		})
	}
	ops := []struct {
		code   string
		status int64
		want   error
	}{
		{codeQuotaExceeded, 403, agent.ErrQuotaExceeded},
		{codeStockout, 503, agent.ErrQuotaExceeded},
		{codeStockoutWithDetails, 503, agent.ErrQuotaExceeded},
		{codeResourceNotFound, 404, agent.ErrNotFound},
		{codeResourceAlreadyExists, 409, errAlreadyExists},
		{codeRateLimitExceeded, 429, agent.ErrTransient},
		{"INTERNAL_ERROR", 500, agent.ErrTransient},
		{"INVALID_FIELD_VALUE", 400, agent.ErrPermanent},
	}
	for _, c := range ops {
		op := &compute.Operation{Name: "op", Status: "DONE", HttpErrorStatusCode: c.status,
			Error: &compute.OperationError{Errors: []*compute.OperationErrorErrors{{Code: c.code, Message: "m"}}}}
		if got := operationError(op); !errors.Is(got, c.want) {
			t.Errorf("operationError(%s) = %v, want %v", c.code, got, c.want)
		}
	}
	if err := operationError(&compute.Operation{Status: "DONE"}); err != nil {
		t.Errorf("operationError(DONE without error) = %v, want nil", err)
	}
}

func TestStateMapping(t *testing.T) {
	d := New(nil, Options{Entry: "gce-eu", Zone: "zone-a", Config: testConfig()})
	nic := func(nat string) []*compute.NetworkInterface {
		return []*compute.NetworkInterface{{NetworkIP: "10.0.0.2", AccessConfigs: []*compute.AccessConfig{{NatIP: nat}}}}
	}
	labels := map[string]string{LabelPort: "3128"}
	cases := []struct {
		status string
		nics   []*compute.NetworkInterface
		want   agent.State
		addr   string
	}{
		{"PROVISIONING", nil, agent.StateProvisioning, ""},
		{"STAGING", nil, agent.StateProvisioning, ""},
		{"RUNNING", nic(""), agent.StateProvisioning, ""},
		{"RUNNING", nic("203.0.113.9"), agent.StateRunning, "203.0.113.9:3128"},
		{"REPAIRING", nic("203.0.113.9"), agent.StateProvisioning, ""},
		{"STOPPING", nic("203.0.113.9"), agent.StateTerminated, ""},
		{"TERMINATED", nil, agent.StateTerminated, ""},
		{"SUSPENDED", nil, agent.StateTerminated, ""},
	}
	for _, c := range cases {
		got := d.toInstance(&compute.Instance{Name: "px-x", Status: c.status, NetworkInterfaces: c.nics, Labels: labels})
		if got.State != c.want || got.Address != c.addr {
			t.Errorf("%s: state %s address %q, want %s %q", c.status, got.State, got.Address, c.want, c.addr)
		}
	}
}

func TestRequestIDIsUUID(t *testing.T) {
	id := RequestID("px-1", "insert", "1")
	if !reUUID.MatchString(id) || id != RequestID("px-1", "insert", "1") {
		t.Fatalf("request ID %q is not a stable UUID", id)
	}
}

func TestImageAndProfileKeys(t *testing.T) {
	f := newFakeCompute(t, "zone-a")
	d := newDriver(t, f, "zone-a", nil, nil)
	s := spec("px-keys", 1)
	s.Image = "windows"
	if _, err := d.Create(ctx(t), s); !errors.Is(err, agent.ErrPermanent) || !strings.Contains(err.Error(), "debian-12") {
		t.Fatalf("unknown image key: %v, want ErrPermanent naming the configured keys", err)
	}
	s.Image, s.Profile = "", "huge"
	if _, err := d.Create(ctx(t), s); !errors.Is(err, agent.ErrPermanent) {
		t.Fatalf("unknown profile key: %v, want ErrPermanent", err)
	}
	if len(f.recorded()) != 0 {
		t.Fatal("a create with a bad key reached the API")
	}
}

var _ http.RoundTripper = wireLog{}
