//go:build integration || e2e || bench

package integration

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/kvm-agent/internal/config"
	"proxyfleet/services/kvm-agent/internal/image"
	"proxyfleet/services/kvm-agent/internal/kvm"
	"proxyfleet/services/kvm-agent/internal/libvirt"
)

func env(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// needLibvirt skips (or fails under PROXYFLEET_REQUIRE_INTEGRATION=1) when
// no libvirtd answers.
func needLibvirt(t *testing.T) (socket, pool, network string) {
	t.Helper()
	socket = env("KVM_TEST_SOCKET", libvirt.DefaultSocket)
	pool = env("KVM_TEST_POOL", "pfci")
	network = env("KVM_TEST_NETWORK", "pfci")
	testgate.NeedBinary(t, "virsh", "install libvirt-clients (make test-kvm does)")
	c, err := net.DialTimeout("unix", socket, 2*time.Second)
	if err == nil {
		c.Close()
	}
	testgate.Need(t, err == nil, "no libvirtd on "+socket+": run make test-kvm, which starts one")
	out, err := virsh(t, "pool-info", pool)
	testgate.Need(t, err == nil, "storage pool "+pool+" missing ("+strings.TrimSpace(out)+"): run make test-kvm")
	return socket, pool, network
}

func virsh(t *testing.T, args ...string) (string, error) {
	t.Helper()
	out, err := exec.Command("virsh", append([]string{"-q", "-c", "qemu:///system"}, args...)...).CombinedOutput()
	return string(out), err
}

func domState(t *testing.T, name string) string {
	out, err := virsh(t, "domstate", name)
	if err != nil {
		return "absent"
	}
	return strings.TrimSpace(out)
}

func volumes(t *testing.T, pool string) []string {
	t.Helper()
	out, err := virsh(t, "vol-list", pool)
	if err != nil {
		t.Fatalf("vol-list: %v: %s", err, out)
	}
	var names []string
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) > 0 {
			names = append(names, f[0])
		}
	}
	return names
}

func hasVolume(t *testing.T, pool, prefix string) []string {
	var out []string
	for _, v := range volumes(t, pool) {
		if strings.HasPrefix(v, prefix) {
			out = append(out, v)
		}
	}
	return out
}

// eventually waits for cond within timeout.
func eventually(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	testwait.Until(t, timeout, what, cond)
}

// testImage makes a small qcow2 disk with qemu-img and serves it.
type origin struct {
	srv  *httptest.Server
	data []byte
	mu   sync.Mutex
	// dieAt > 0: the body stops after dieAt bytes and the connection dies.
	dieAt int
	// hold, when set, is waited for after half of the body.
	hold chan struct{}
	sent chan struct{}
}

func newOrigin(t *testing.T) *origin {
	t.Helper()
	testgate.NeedBinary(t, "qemu-img", "install qemu-utils (make test-kvm does)")
	p := filepath.Join(t.TempDir(), "disk.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", p, "64M").CombinedOutput(); err != nil {
		t.Fatalf("qemu-img: %v: %s", err, out)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	// Pad to a few MiB so uploads take more than one stream packet.
	pad := make([]byte, 6<<20)
	b = append(b, pad...)
	o := &origin{data: b}
	o.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		o.mu.Lock()
		dieAt, hold, sent := o.dieAt, o.hold, o.sent
		o.mu.Unlock()
		w.Header().Set("Content-Length", strconv.Itoa(len(o.data)))
		switch {
		case dieAt > 0:
			_, _ = w.Write(o.data[:dieAt])
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		case hold != nil:
			half := len(o.data) / 2
			_, _ = w.Write(o.data[:half])
			w.(http.Flusher).Flush()
			close(sent)
			select {
			case <-hold:
			case <-r.Context().Done():
				return
			}
			_, _ = w.Write(o.data[half:])
		default:
			_, _ = w.Write(o.data)
		}
	}))
	t.Cleanup(o.srv.Close)
	return o
}

func randomEntry(t *testing.T) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return "it-" + hex.EncodeToString(b[:])
}

func testConfig(t *testing.T, entry, socket, pool, network, url string) *config.Config {
	t.Helper()
	doc := fmt.Sprintf(`
entry: %s
target: ci
libvirt: {socket: %s, rpcTimeout: 30s, transferTimeout: 5m}
pool: %s
network: %s
domainType: qemu
images:
  tiny: {url: %q, format: qcow2, firmware: bios}
profiles:
  small: {vcpus: 1, memoryMiB: 128, diskGiB: 1}
installGuestAgent: true
`, entry, socket, pool, network, url)
	cfg, err := config.Parse([]byte(doc))
	if err != nil {
		t.Fatalf("config: %v", err)
	}
	return cfg
}

// cleanupEntry removes whatever an entry left: domains of its proxies and
// its volumes (base, marker, overlays, seeds).
func cleanupEntry(t *testing.T, pool, entry string, instances ...string) {
	t.Cleanup(func() {
		for _, n := range instances {
			_, _ = virsh(t, "destroy", n)
			_, _ = virsh(t, "undefine", "--nvram", n)
		}
		for _, v := range volumes(t, pool) {
			keep := !strings.HasPrefix(v, "base-"+entry+"-")
			for _, n := range instances {
				if strings.HasPrefix(v, n) {
					keep = false
				}
			}
			if !keep {
				_, _ = virsh(t, "vol-delete", "--pool", pool, v)
			}
		}
	})
}

// startAgent opens the kvm stack of cfg, publishing its progress on conn,
// and runs the agent runtime over its driver with rc (Info is the
// driver's) until the test ends; the runtime stops, then the stack closes.
func startAgent(t *testing.T, conn *bus.Conn, cfg *config.Config, o kvm.Options, rc agent.Config) *kvm.Stack {
	t.Helper()
	o.Publish = conn.NC.Publish
	stack := kvm.Open(cfg, o)
	t.Cleanup(stack.Close)
	rc.Info = stack.Driver.Info()
	rt, err := agent.New(conn, stack.Driver, rc, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	agenttest.Serve(t, rt.Run)
	return stack
}

// fileSHA256 is the hex sha256 of the file at path.
func fileSHA256(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

func spec(entry, proxy string) agent.Spec {
	return agent.Spec{ProxyID: proxy, Pool: "web", Entry: entry, Target: "ci", Name: events.InstanceName(proxy), Attempt: 1, Port: 3128}
}

// TestLifecycleThroughNATS drives create and delete commands through
// JetStream and the agent runtime into a real libvirtd.
func TestLifecycleThroughNATS(t *testing.T) {
	socket, pool, network := needLibvirt(t)
	o := newOrigin(t)
	entry := randomEntry(t)
	proxy := "web-lifecycle"
	name := events.InstanceName(proxy)
	cleanupEntry(t, pool, entry, name)
	cfg := testConfig(t, entry, socket, pool, network, o.srv.URL+"/tiny.qcow2")

	conn := bustest.Start(t)
	progress := make(chan image.Progress, 1000)
	sub, err := conn.NC.Subscribe(events.ProgressSubject(entry, "ci"), func(m *natsMsg) {
		var p image.Progress
		if json.Unmarshal(m.Data, &p) == nil {
			progress <- p
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	ctx := t.Context()
	startAgent(t, conn, cfg, kvm.Options{ProgressEvery: time.Millisecond}, agent.Config{CommandTimeout: 20 * time.Second, WatchInterval: time.Second})

	start := time.Now()
	create := events.CreateCommand{ProxyID: proxy, ProxySpec: events.ProxySpec{Pool: "web", Entry: entry, Target: "ci", Instance: name, Port: 3128}, Attempt: 1}
	if _, err := bus.PublishCreate(ctx, conn, "test", create, 0); err != nil {
		t.Fatal(err)
	}
	store := bus.NewEventStore(conn, "test", nil)
	eventually(t, "provisioning event", 60*time.Second, func() bool {
		last, err := store.Last(ctx, events.AggregateProxy, proxy)
		return err == nil && last != nil && last.Kind == events.ProxyProvisioning
	})
	eventually(t, "domain running", 120*time.Second, func() bool { return domState(t, name) == "running" })
	t.Logf("command to running domain: %s", time.Since(start).Round(time.Millisecond))
	for _, v := range []string{kvm.OverlayName(name), kvm.SeedName(name), image.VolumeName(entry, "tiny", "qcow2"), image.MarkerName(image.VolumeName(entry, "tiny", "qcow2"))} {
		if !slices.Contains(volumes(t, pool), v) {
			t.Errorf("volume %s missing; pool has %v", v, volumes(t, pool))
		}
	}
	xml, _ := virsh(t, "dumpxml", name)
	overlayPath, _ := virsh(t, "vol-path", "--pool", pool, kvm.OverlayName(name))
	if !strings.Contains(xml, "<source file='"+strings.TrimSpace(overlayPath)+"'") {
		t.Errorf("domain does not boot from its overlay %s", overlayPath)
	}
	var sawProgress bool
	for len(progress) > 0 {
		p := <-progress
		if p.Image == "tiny" && p.Total == uint64(len(o.data)) && p.Done > 0 {
			sawProgress = true
		}
	}
	if !sawProgress {
		t.Error("no download progress was published")
	}

	del := events.DeleteCommand{ProxyID: proxy, Pool: "web", Entry: entry, Target: "ci", Instance: name, Attempt: 1}
	if _, err := bus.PublishDelete(ctx, conn, "test", del, 0); err != nil {
		t.Fatal(err)
	}
	eventually(t, "deleted event", 90*time.Second, func() bool {
		last, err := store.Last(ctx, events.AggregateProxy, proxy)
		return err == nil && last != nil && last.Kind == events.ProxyDeleted
	})
	if st := domState(t, name); st != "absent" {
		t.Errorf("domain state after delete = %q, want absent", st)
	}
	if left := hasVolume(t, pool, name); len(left) != 0 {
		t.Errorf("volumes left after delete: %v", left)
	}
}

func TestCrashBetweenDefineAndStartLeavesOneDomain(t *testing.T) {
	socket, pool, network := needLibvirt(t)
	o := newOrigin(t)
	entry := randomEntry(t)
	s := spec(entry, "web-crash")
	cleanupEntry(t, pool, entry, s.Name)
	stack := kvm.Open(testConfig(t, entry, socket, pool, network, o.srv.URL), kvm.Options{})
	defer stack.Close()
	ctx := context.Background()
	if _, err := stack.Driver.Create(ctx, s); err != nil {
		t.Fatalf("Create: %v", err)
	}
	// The state a crash after DomainDefineXML and before DomainCreate leaves.
	if out, err := virsh(t, "destroy", s.Name); err != nil {
		t.Fatalf("destroy: %v %s", err, out)
	}
	if st := domState(t, s.Name); st != "shut off" {
		t.Fatalf("state = %q, want shut off", st)
	}
	if _, err := stack.Driver.Create(ctx, s); err != nil {
		t.Fatalf("Create after crash: %v", err)
	}
	out, _ := virsh(t, "list", "--all", "--name")
	n := strings.Count(out, s.Name)
	if n != 1 || domState(t, s.Name) != "running" {
		t.Errorf("domains named %s = %d, state %q; want one, running", s.Name, n, domState(t, s.Name))
	}
	if err := stack.Driver.Delete(ctx, agent.Ref{Name: s.Name}); err != nil {
		t.Fatalf("Delete: %v", err)
	}
}

func TestDownloadFailingHalfWay(t *testing.T) {
	socket, pool, network := needLibvirt(t)
	o := newOrigin(t)
	o.dieAt = len(o.data) / 2
	entry := randomEntry(t)
	s := spec(entry, "web-halfway")
	cleanupEntry(t, pool, entry, s.Name)
	httpc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	stack := kvm.Open(testConfig(t, entry, socket, pool, network, o.srv.URL), kvm.Options{HTTP: httpc})
	defer stack.Close()
	ctx := context.Background()
	// Warm the shared connection so its goroutines predate the snapshot.
	if _, err := stack.Driver.List(ctx); err != nil {
		t.Fatal(err)
	}
	ignore := goleak.IgnoreCurrent()

	_, err := stack.Driver.Create(ctx, s)
	if !errors.Is(err, agent.ErrTransient) {
		t.Fatalf("Create with a dying download = %v, want transient", err)
	}
	base := image.VolumeName(entry, "tiny", "qcow2")
	if left := hasVolume(t, pool, base); len(left) != 0 {
		t.Fatalf("partial base left: %v", left)
	}
	stack.Images.Wait()
	goleak.VerifyNone(t, ignore)

	o.mu.Lock()
	o.dieAt = 0
	o.mu.Unlock()
	if _, err := stack.Driver.Create(ctx, s); err != nil {
		t.Fatalf("next attempt: %v", err)
	}
	if len(hasVolume(t, pool, image.MarkerName(base))) != 1 {
		t.Error("no marker after the successful fetch")
	}
	if err := stack.Driver.Delete(ctx, agent.Ref{Name: s.Name}); err != nil {
		t.Fatal(err)
	}
}

// killDialer remembers every connection it made so the test can break them.
type killDialer struct {
	libvirt.Dialer
	mu    sync.Mutex
	conns []net.Conn
	dials int
}

func (k *killDialer) dialled() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.dials
}

func (k *killDialer) Dial(ctx context.Context) (net.Conn, error) {
	c, err := k.Dialer.Dial(ctx)
	if err == nil {
		k.mu.Lock()
		k.conns = append(k.conns, c)
		k.dials++
		k.mu.Unlock()
	}
	return c, err
}

func (k *killDialer) killAll() {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, c := range k.conns {
		_ = c.Close()
	}
	k.conns = nil
}

func TestConnectionKilledUnderARunningOperation(t *testing.T) {
	socket, pool, network := needLibvirt(t)
	o := newOrigin(t)
	o.hold = make(chan struct{})
	o.sent = make(chan struct{})
	entry := randomEntry(t)
	s := spec(entry, "web-killed")
	cleanupEntry(t, pool, entry, s.Name)
	var kd *killDialer
	stack := kvm.Open(testConfig(t, entry, socket, pool, network, o.srv.URL), kvm.Options{Dialer: func(d libvirt.Dialer) libvirt.Dialer {
		kd = &killDialer{Dialer: d}
		return kd
	}})
	defer stack.Close()
	ctx := context.Background()

	errc := make(chan error, 1)
	go func() { _, err := stack.Driver.Create(ctx, s); errc <- err }()
	<-o.sent // the download is half way, held
	// The upload runs on a connection of its own: wait until it is dialled.
	eventually(t, "the upload connection", 30*time.Second, func() bool { return kd.dialled() >= 2 })
	kd.killAll()
	close(o.hold)
	err := <-errc
	if !errors.Is(err, agent.ErrTransient) {
		t.Fatalf("Create with its connection killed = %v, want transient", err)
	}
	if left := hasVolume(t, pool, image.VolumeName(entry, "tiny", "qcow2")); len(left) != 0 {
		t.Errorf("partial base left: %v", left)
	}
	o.mu.Lock()
	o.hold = nil
	o.mu.Unlock()
	// Recovery: the next call dials again.
	if _, err := stack.Driver.Create(ctx, s); err != nil {
		t.Fatalf("Create after the kill: %v", err)
	}
	if st := domState(t, s.Name); st != "running" {
		t.Errorf("state = %q, want running", st)
	}
	// Killing the shared connection under a Get is transient too, and
	// the next Get recovers.
	kd.killAll()
	if _, err := stack.Driver.Get(ctx, agent.Ref{Name: s.Name}); err != nil && !errors.Is(err, agent.ErrTransient) {
		t.Errorf("Get on a killed connection = %v, want transient or success", err)
	}
	if _, err := stack.Driver.Get(ctx, agent.Ref{Name: s.Name}); err != nil {
		t.Errorf("Get after redial: %v", err)
	}
	if v := stack.Driver.Check(ctx); len(v) != 4 || !v[0].OK || !v[2].OK {
		t.Errorf("Check = %+v", v)
	}
	if err := stack.Driver.Delete(ctx, agent.Ref{Name: s.Name}); err != nil {
		t.Fatal(err)
	}
}

func TestTwoEntriesSameKeyTwoBases(t *testing.T) {
	socket, pool, network := needLibvirt(t)
	o := newOrigin(t)
	ctx := context.Background()
	var bases []string
	for i := 0; i < 2; i++ {
		entry := randomEntry(t)
		cleanupEntry(t, pool, entry)
		stack := kvm.Open(testConfig(t, entry, socket, pool, network, o.srv.URL), kvm.Options{})
		defer stack.Close()
		b, err := stack.Images.Ensure(ctx, image.Source{Key: "tiny", URL: o.srv.URL, Format: "qcow2"})
		if err != nil {
			t.Fatalf("Ensure: %v", err)
		}
		bases = append(bases, b.Path)
		if len(hasVolume(t, pool, image.VolumeName(entry, "tiny", "qcow2"))) != 2 { // base and its marker
			t.Errorf("entry %s: base and marker missing: %v", entry, volumes(t, pool))
		}
	}
	if bases[0] == bases[1] {
		t.Errorf("two entries share %s", bases[0])
	}
}
