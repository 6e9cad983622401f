package kvm

import (
	"context"
	"errors"
	"flag"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	golibvirt "github.com/digitalocean/go-libvirt"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
	"proxyfleet/services/kvm-agent/internal/config"
	"proxyfleet/services/kvm-agent/internal/image"
	"proxyfleet/services/kvm-agent/internal/libvirt"
	"proxyfleet/services/kvm-agent/internal/libvirt/libvirtfake"
)

var update = flag.Bool("update", false, "rewrite golden files")

func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read golden (run with -update to create): %v", err)
	}
	if got != string(want) {
		t.Errorf("%s differs from the golden file:\n--- got\n%s\n--- want\n%s", name, got, want)
	}
}

func params(uefi bool) domainParams {
	return domainParams{
		Name: "px-abcdefghijklmnop", Type: "kvm", Image: "debian-12", Port: 3128,
		Marker: agent.Marker{ProxyID: "web-abc", Pool: "web", Entry: "kvm-home"},
		VCPUs:  2, MemoryMiB: 1024, UEFI: uefi,
		DiskPath: "/var/lib/libvirt/images/px-abcdefghijklmnop.qcow2", DiskFormat: "qcow2",
		SeedPath: "/var/lib/libvirt/images/px-abcdefghijklmnop-cidata.iso",
		Network:  "default", MAC: macFor("px-abcdefghijklmnop"),
	}
}

func TestDomainXMLGolden(t *testing.T) {
	golden(t, "domain-uefi.xml", domainXML(params(true)))
	bios := params(false)
	bios.Type = "qemu"
	bios.Network = ""
	bios.Bridge = "br0"
	bios.VLAN = 42
	bios.SerialLog = "/var/log/proxyfleet/px-abcdefghijklmnop.log"
	golden(t, "domain-bios-bridge-vlan.xml", domainXML(bios))
}

func TestDomainXMLUsesFileDisksOnly(t *testing.T) {
	x := domainXML(params(true))
	// AppArmor (virt-aa-helper) grants QEMU access to disk paths only.
	for _, bad := range []string{"type='volume'", "<source pool=", " volume="} {
		if strings.Contains(x, bad) {
			t.Errorf("domain XML references a pool volume (%q)", bad)
		}
	}
	for _, want := range []string{"machine='q35'", "model='virtio-scsi'", "<target dev='sda' bus='scsi'/>", "<serial type='pty'/>", "<console type='pty'/>", "<source file='/var/lib/libvirt/images/px-abcdefghijklmnop.qcow2'/>", "name='org.qemu.guest_agent.0'", "name='secure-boot'", "firmware='efi'"} {
		if !strings.Contains(x, want) {
			t.Errorf("domain XML lacks %q", want)
		}
	}
}

func TestVolumeXMLGolden(t *testing.T) {
	golden(t, "overlay.xml", overlayVolumeXML("px-a.qcow2", 10, "/var/lib/libvirt/images/base-kvm-home-debian-12.qcow2", "qcow2"))
	golden(t, "seed.xml", seedVolumeXML("px-a-cidata.iso", 366592))
}

func TestParseMarkerWithoutNamespace(t *testing.T) {
	// What libvirtd returns from virDomainGetMetadata: the element without
	// the namespace declaration it was defined with.
	bare := "<instance>\n  <proxy>web-abc</proxy>\n  <pool>web</pool>\n  <entry>kvm-home</entry>\n  <image>debian-12</image>\n  <port>3128</port>\n</instance>"
	withNS := "<pf:instance xmlns:pf='" + MetadataURI + "'><pf:proxy>web-abc</pf:proxy><pf:pool>web</pf:pool><pf:entry>kvm-home</pf:entry><pf:port>3128</pf:port></pf:instance>"
	for _, s := range []string{bare, withNS} {
		m, err := parseMarker(s)
		if err != nil {
			t.Fatalf("parseMarker(%q): %v", s, err)
		}
		want := agent.Marker{ProxyID: "web-abc", Pool: "web", Entry: "kvm-home"}
		if m.agentMarker() != want || m.Port != 3128 {
			t.Errorf("marker = %+v, want %+v port 3128", m, want)
		}
	}
	if _, err := parseMarker("<instance><pool>x</pool></instance>"); err == nil {
		t.Error("marker without proxy accepted")
	}
}

func testConfig(url string) *config.Config {
	cfg, err := config.Parse([]byte(`
entry: kvm-home
target: host1
pool: default
network: default
domainType: qemu
images:
  deb: {url: "` + url + `", firmware: bios}
profiles:
  small: {vcpus: 1, memoryMiB: 256, diskGiB: 1}
`))
	if err != nil {
		panic(err)
	}
	return cfg
}

func newDriver(t *testing.T) (*Driver, *libvirtfake.Fake) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("base-image")) }))
	t.Cleanup(srv.Close)
	f := libvirtfake.New("default")
	cfg := testConfig(srv.URL + "/deb.qcow2")
	images := image.New(f, image.Config{Entry: cfg.Entry, Pool: cfg.Pool}, nil)
	return New(cfg, f, f, images, nil), f
}

func spec(proxy string) agent.Spec {
	return agent.Spec{ProxyID: proxy, Pool: "web", Entry: "kvm-home", Target: "host1", Name: events.InstanceName(proxy), Attempt: 1, Port: 3128}
}

func TestCreateGetDeleteList(t *testing.T) {
	ctx := context.Background()
	d, f := newDriver(t)
	s := spec("web-abc")
	inst, err := d.Create(ctx, s)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	if inst.State != agent.StateProvisioning || inst.ProviderID != "host1/"+s.Name {
		t.Errorf("instance = %+v", inst)
	}
	xml, running, ok := f.DomainXML(s.Name)
	if !ok || !running {
		t.Fatalf("domain defined=%v running=%v", ok, running)
	}
	for _, want := range []string{"/pools/default/" + s.Name + ".qcow2", "/pools/default/" + s.Name + "-cidata.iso", "<domain type='qemu'>"} {
		if !strings.Contains(xml, want) {
			t.Errorf("domain XML lacks %q", want)
		}
	}
	if _, ok := f.Volume("default", SeedName(s.Name)); !ok {
		t.Error("no seed volume")
	}

	// Idempotent: a second create finds the domain.
	if _, err := d.Create(ctx, s); err != nil {
		t.Fatalf("second Create: %v", err)
	}
	if n := f.Calls["virDomainDefineXML"]; n != 1 {
		t.Errorf("defined %d times, want 1", n)
	}

	// No address yet: the agent is not up, the lease and ARP are empty.
	f.AddrErrs[libvirt.SourceAgent] = &libvirt.Error{RPC: "virDomainInterfaceAddresses", Code: uint32(golibvirt.ErrAgentUnresponsive), Message: "agent not connected"}
	got, err := d.Get(ctx, agent.Ref{ProxyID: s.ProxyID, Name: s.Name})
	if err != nil || got.State != agent.StateProvisioning {
		t.Fatalf("Get = %+v, %v; want provisioning", got, err)
	}
	f.Addresses[libvirt.SourceLease] = []libvirt.DomainInterface{{Name: "vnet0", Hwaddr: []string{macFor(s.Name)}, Addrs: []golibvirt.DomainIPAddr{{Addr: "fe80::1"}, {Addr: "192.168.122.50", Prefix: 24}}}}
	got, err = d.Get(ctx, agent.Ref{ProxyID: s.ProxyID, Name: s.Name})
	if err != nil || got.State != agent.StateRunning || got.Address != "192.168.122.50:3128" {
		t.Fatalf("Get = %+v, %v; want running at 192.168.122.50:3128", got, err)
	}

	// An unmarked domain is never touched (nor listed: the conformance
	// suite's ListOnlyMarked).
	f.DefineRaw("someone-else", "<domain><name>someone-else</name></domain>")
	if err := d.Delete(ctx, agent.Ref{Name: "someone-else"}); !errors.Is(err, agent.ErrPermanent) {
		t.Errorf("Delete of an unmarked domain = %v, want permanent refusal", err)
	}
	if _, _, ok := f.DomainXML("someone-else"); !ok {
		t.Error("unmarked domain was removed")
	}

	if err := d.Delete(ctx, agent.Ref{ProxyID: s.ProxyID, Name: s.Name}); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if _, _, ok := f.DomainXML(s.Name); ok {
		t.Error("domain left after delete")
	}
	for _, v := range f.Volumes("default") {
		if strings.HasPrefix(v, s.Name) {
			t.Errorf("volume %s left after delete", v)
		}
	}
}

func TestCreateAfterCrashBetweenDefineAndStart(t *testing.T) {
	ctx := context.Background()
	d, f := newDriver(t)
	s := spec("web-crash")
	if _, err := d.Create(ctx, s); err != nil {
		t.Fatal(err)
	}
	// Simulate the crash: the domain is defined but not running.
	if err := f.DomainDestroy(ctx, libvirt.Domain{Name: s.Name}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Create(ctx, s); err != nil {
		t.Fatalf("Create after crash: %v", err)
	}
	_, running, _ := f.DomainXML(s.Name)
	if !running || f.Calls["virDomainDefineXML"] != 1 {
		t.Errorf("running=%v defines=%d; want running, one definition", running, f.Calls["virDomainDefineXML"])
	}
}

func TestAddressSources(t *testing.T) {
	ctx := context.Background()
	lerr := &libvirt.Error{RPC: "virDomainInterfaceAddresses", Code: uint32(golibvirt.ErrInvalidArg), Message: "x"}
	tests := []struct {
		name      string
		errs      map[uint32]error
		wantIP    string
		wantClass string
	}{
		{"one source failing is no address yet", map[uint32]error{libvirt.SourceAgent: lerr}, "", ""},
		{"two failing is no address yet", map[uint32]error{libvirt.SourceAgent: lerr, libvirt.SourceARP: lerr}, "", ""},
		{"every source failing is transient, not permanent", map[uint32]error{libvirt.SourceAgent: lerr, libvirt.SourceLease: lerr, libvirt.SourceARP: lerr}, "", agent.ClassTransient},
		{"a dead connection is transient", map[uint32]error{libvirt.SourceAgent: agent.Wrap(agent.ErrTransient, errors.New("connection is closed"))}, "", agent.ClassTransient},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d, f := newDriver(t)
			f.AddrErrs = tc.errs
			ip, err := d.address(ctx, libvirt.Domain{Name: "px-a"}, "52:54:00:00:00:01")
			if ip != tc.wantIP || agent.Classify(err) != tc.wantClass {
				t.Errorf("address = %q, %v (class %q); want %q class %q", ip, err, agent.Classify(err), tc.wantIP, tc.wantClass)
			}
		})
	}
}

func TestCheck(t *testing.T) {
	d, _ := newDriver(t)
	v := d.Check(context.Background())
	if len(v) != 4 {
		t.Fatalf("verdicts = %+v, want libvirt, hostname, pool, space", v)
	}
	for _, x := range v {
		if !x.OK {
			t.Errorf("verdict %+v not OK", x)
		}
	}
}
