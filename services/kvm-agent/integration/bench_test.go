//go:build bench

package integration

import (
	"bufio"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/services/kvm-agent/internal/image"
	"proxyfleet/services/kvm-agent/internal/kvm"
)

// TestBenchKVM measures, against the tier's libvirtd, in one run: the
// base-image upload throughput of the image cache (HTTP download, sha256
// tee, StorageVolUpload) against `virsh vol-upload` of the same file, as a
// ratio; the overhead of a create with a cached base (overlay, seed,
// define, start; no guest boot); and the RSS of an idle agent. It reports
// numbers and asserts none of them (make bench-kvm).
func TestBenchKVM(t *testing.T) {
	socket, pool, network := needLibvirt(t)
	const size = 256 << 20
	dir := t.TempDir()
	// A real qcow2 header (the overlays need one), padded with random
	// bytes to the benchmark size.
	file := filepath.Join(dir, "image.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", file, "1G").CombinedOutput(); err != nil {
		t.Fatalf("qemu-img: %v %s", err, out)
	}
	st, err := os.Stat(file)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(file, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.CopyN(f, rand.Reader, size-st.Size()); err != nil {
		t.Fatal(err)
	}
	f.Close()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { http.ServeFile(w, r, file) }))
	defer srv.Close()
	ctx := context.Background()

	// virsh vol-upload of the same file.
	vname := "bench-virsh.raw"
	t.Cleanup(func() { _, _ = virsh(t, "vol-delete", "--pool", pool, vname) })
	if out, err := virsh(t, "vol-create-as", pool, vname, fmt.Sprint(size), "--format", "raw"); err != nil {
		t.Fatalf("vol-create-as: %v %s", err, out)
	}
	start := time.Now()
	if out, err := virsh(t, "vol-upload", "--pool", pool, vname, file); err != nil {
		t.Fatalf("vol-upload: %v %s", err, out)
	}
	virshDur := time.Since(start)

	entry := randomEntry(t)
	cleanupEntry(t, pool, entry, events.InstanceName("bench-0"), events.InstanceName("bench-1"), events.InstanceName("bench-2"), events.InstanceName("bench-3"), events.InstanceName("bench-4"))
	cfg := testConfig(t, entry, socket, pool, network, srv.URL)
	stack := kvm.Open(cfg, kvm.Options{})
	defer stack.Close()
	start = time.Now()
	if _, err := stack.Images.Ensure(ctx, image.Source{Key: "tiny", URL: srv.URL, Format: "qcow2"}); err != nil {
		t.Fatalf("Ensure: %v", err)
	}
	agentDur := time.Since(start)
	mbps := func(d time.Duration) float64 { return float64(size) / (1 << 20) / d.Seconds() }

	// The libvirt half alone: the seam's upload from the local file.
	rpc := stack.Host.RPC()
	p, err := rpc.StoragePoolLookupByName(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	seamName := "bench-seam.raw"
	t.Cleanup(func() { _, _ = virsh(t, "vol-delete", "--pool", pool, seamName) })
	vol, err := rpc.StorageVolCreateXML(ctx, p, fmt.Sprintf("<volume><name>%s</name><capacity unit='bytes'>%d</capacity><target><format type='raw'/></target></volume>", seamName, size))
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	if err := rpc.StorageVolUpload(ctx, vol, src, size); err != nil {
		t.Fatalf("seam upload: %v", err)
	}
	seamDur := time.Since(start)
	src.Close()
	// What libvirtd wrote must be the file, byte for byte.
	want := fileSHA256(t, file)
	for _, v := range []string{seamName, image.VolumeName(entry, "tiny", "qcow2")} {
		path, err := virsh(t, "vol-path", "--pool", pool, v)
		if err != nil {
			t.Fatalf("vol-path %s: %v", v, err)
		}
		if got := fileSHA256(t, strings.TrimSpace(path)); got != want {
			t.Fatalf("volume %s differs from the uploaded file: sha256 %s, want %s", v, got, want)
		}
	}

	// Create overhead with the base cached.
	const n = 5
	var total time.Duration
	for i := 0; i < n; i++ {
		s := spec(entry, fmt.Sprintf("bench-%d", i))
		start := time.Now()
		if _, err := stack.Driver.Create(ctx, s); err != nil {
			t.Fatalf("Create: %v", err)
		}
		total += time.Since(start)
		if err := stack.Driver.Delete(ctx, agent.Ref{Name: s.Name}); err != nil {
			t.Fatalf("Delete: %v", err)
		}
	}

	rss := idleRSS(t, socket, pool, network, srv.URL)

	fmt.Printf("kvm bench: upload %d MiB: agent %.0f MiB/s (%s), virsh vol-upload %.0f MiB/s (%s), ratio agent/virsh %.2f\n",
		size>>20, mbps(agentDur), agentDur.Round(time.Millisecond), mbps(virshDur), virshDur.Round(time.Millisecond), virshDur.Seconds()/agentDur.Seconds())
	fmt.Printf("kvm bench: of which the libvirt stream alone (local file through the seam): %.0f MiB/s (%s)\n", mbps(seamDur), seamDur.Round(time.Millisecond))
	fmt.Printf("kvm bench: create with a cached base (overlay, seed, define, start; no boot): %s mean of %d\n", (total / n).Round(time.Millisecond), n)
	fmt.Printf("kvm bench: idle agent RSS %s\n", rss)
}

// idleRSS starts the kvm-agent binary against a NATS server of the test's
// (agents do not embed one), waits until it serves, lets it idle, and reads
// its VmRSS.
func idleRSS(t *testing.T, socket, pool, network, url string) string {
	dir := t.TempDir()
	bin := filepath.Join(dir, "kvm-agent")
	if out, err := exec.Command("go", "build", "-tags", "grpcnotrace", "-o", bin, "../cmd/kvm-agent").CombinedOutput(); err != nil {
		t.Fatalf("build: %v %s", err, out)
	}
	cfgPath := filepath.Join(dir, "kvm-agent.yaml")
	doc := fmt.Sprintf("entry: %s\ntarget: ci\nlibvirt: {socket: %s}\npool: %s\nnetwork: %s\ndomainType: qemu\nimages: {tiny: {url: %q}}\nprofiles: {small: {vcpus: 1, memoryMiB: 128, diskGiB: 1}}\n",
		randomEntry(t), socket, pool, network, url)
	if err := os.WriteFile(cfgPath, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	nats := bustest.Start(t)
	cmd := exec.Command(bin, "--config", cfgPath, "--data-dir", filepath.Join(dir, "data"), "--nats-url", nats.ClientURL())
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Signal(os.Interrupt); _ = cmd.Wait() }()
	started := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		once := false
		for sc.Scan() {
			if !once && strings.Contains(sc.Text(), "agent started") {
				once = true
				close(started)
			}
		}
	}()
	select {
	case <-started:
	case <-time.After(60 * time.Second):
		t.Fatal("agent did not start")
	}
	time.Sleep(10 * time.Second) // idle: a few heartbeats
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "VmRSS:") {
			return strings.TrimSpace(strings.TrimPrefix(l, "VmRSS:"))
		}
	}
	return "unknown"
}
