//go:build e2e

package integration

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testgate"
	"proxyfleet/services/kvm-agent/internal/config"
	"proxyfleet/services/kvm-agent/internal/kvm"
)

// TestGuestBootsAndProxies boots the guest built by scripts/build-guest.sh
// through the product's normal path (image cache upload, overlay, seed ISO,
// domain XML, start) under TCG, waits for the agent to report its address
// from the DHCP lease, and sends a real HTTP request through the forward
// proxy the seed's user-data starts. It runs inside the tier's network
// namespace, where the guests' network is.
func TestGuestBootsAndProxies(t *testing.T) {
	g := needGuestTier(t)
	gateway := g.gateway
	// The site fetched through the guest's proxy.
	const greeting = "hello through the guest"
	sl := serveGreeting(t, gateway, greeting)

	entry := randomEntry(t)
	proxy := "boot-e2e"
	name := events.InstanceName(proxy)
	cleanupEntry(t, g.pool, entry, name)
	conn, stack := g.agentOn(t, entry)
	ctx := t.Context()

	userData := []byte("#!/bin/sh\nexec /bin/fwdproxy -listen :3128\n")
	store := bus.NewEventStore(conn, events.SourcePlanner, nil)
	// Record the decision as the planner would, so the health service
	// projects the proxy and probes it once it runs.
	requested := events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: "web", Entry: entry, Target: "ci", Instance: name, Revision: 1, Port: 3128}}
	if _, err := store.Append(ctx, events.AggregateProxy, proxy, events.ProxyRequested,
		events.ProxyEventID(proxy, events.ProxyRequested, 1), requested, &bus.Expect{Seq: 0}); err != nil {
		t.Fatal(err)
	}
	startHealth(t, conn.ClientURL(), gateway)
	start := time.Now()
	create := events.CreateCommand{ProxyID: proxy, ProxySpec: events.ProxySpec{Pool: "web", Entry: entry, Target: "ci", Instance: name, Port: 3128}, Attempt: 1, UserData: userData}
	if _, err := bus.PublishCreate(ctx, conn, "e2e", create, 0); err != nil {
		t.Fatal(err)
	}
	var running events.ProxyRunningData
	eventually(t, "the running event with an address", 5*time.Minute, func() bool {
		last, err := store.Last(ctx, events.AggregateProxy, proxy)
		if err != nil || last == nil {
			return false
		}
		if last.Kind == events.ProxyFailed {
			t.Fatalf("proxy failed: %s", last.Data)
		}
		return last.Kind == events.ProxyRunning && last.DecodeData(&running) == nil
	})
	t.Logf("command to running (address %s): %s", running.Address, time.Since(start).Round(time.Millisecond))

	proxyURL := &url.URL{Scheme: "http", Host: running.Address}
	client := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(proxyURL)}, Timeout: 10 * time.Second}
	var body string
	eventually(t, "an HTTP request through the guest's proxy", 2*time.Minute, func() bool {
		resp, err := client.Get("http://" + sl.Addr().String() + "/")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		body = string(b)
		return resp.StatusCode == http.StatusOK
	})
	if body != greeting {
		t.Fatalf("body through the proxy = %q, want %q", body, greeting)
	}
	fmt.Printf("kvm e2e: command to a working HTTP request through the guest's proxy %s\n", time.Since(start).Round(time.Millisecond))

	// The health service probes through the guest's proxy (plain HTTP and
	// CONNECT to its echo endpoint on the gateway) and records ready.
	var ready events.ProxyReadyData
	eventually(t, "the health service's ready event", 2*time.Minute, func() bool {
		last, err := store.Last(ctx, events.AggregateProxy, proxy)
		return err == nil && last != nil && last.Kind == events.ProxyReady && last.DecodeData(&ready) == nil
	})
	fmt.Printf("kvm e2e: command to ready (health probe through the guest, egress %s) %s\n", ready.EgressIP, time.Since(start).Round(time.Millisecond))

	// Both address sources the agent prefers answer with the same address:
	// the guest agent (qemu-ga in the guest) and the DHCP lease.
	ip, _, _ := net.SplitHostPort(running.Address)
	for _, source := range []string{"agent", "lease"} {
		var out string
		eventually(t, "virsh domifaddr --source "+source, 2*time.Minute, func() bool {
			out, _ = virsh(t, "domifaddr", "--source", source, name)
			return strings.Contains(out, ip+"/")
		})
	}

	if err := stack.Driver.Delete(ctx, agent.Ref{ProxyID: proxy, Name: name}); err != nil {
		t.Fatalf("Delete: %v", err)
	}
}

// serveGreeting serves greeting over HTTP on host (the guest network's
// gateway) until the test ends and returns its listener.
func serveGreeting(t *testing.T, host, greeting string) net.Listener {
	t.Helper()
	site := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, greeting) })}
	sl, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatalf("listen on the guest network's gateway: %v", err)
	}
	go func() { _ = site.Serve(sl) }()
	t.Cleanup(func() { _ = site.Close() })
	return sl
}

// startHealth builds and runs the health service on the guest network's
// gateway, where guests reach its echo endpoint through their proxies.
func startHealth(t *testing.T, natsURL, gateway string) {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(gateway, "0"))
	if err != nil {
		t.Fatal(err)
	}
	echoAddr := l.Addr().String()
	l.Close()
	startHealthEcho(t, natsURL, echoAddr)
}

// startHealthEcho builds and runs the health service with its echo
// endpoint on echoAddr.
func startHealthEcho(t *testing.T, natsURL, echoAddr string) {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "health")
	if out, err := exec.Command("go", "build", "-tags", "grpcnotrace", "-o", bin, "proxyfleet/services/health/cmd/health").CombinedOutput(); err != nil {
		t.Fatalf("build health: %v\n%s", err, out)
	}
	logf, err := os.Create(filepath.Join(dir, "health.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--nats-url", natsURL, "--data-dir", filepath.Join(dir, "data"),
		"--echo-addr", echoAddr, "--probe-interval", "1s", "--probe-timeout", "5s")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			t.Logf("health log:\n%s", b)
		}
		logf.Close()
	})
}

// guestTier is what make e2e-kvm gives the boot tests: libvirt in the
// tier's network namespace, the guest image built by build-guest.sh
// (served here over HTTP, as an image origin) and the host's address on the
// guests' network.
type guestTier struct {
	socket, pool, network, gateway string
	imageAddr                      net.Addr
}

func needGuestTier(t *testing.T) guestTier {
	t.Helper()
	return needImageTier(t, "KVM_TEST_GUEST_IMAGE", "build it with services/kvm-agent/scripts/build-guest.sh (make e2e-kvm does)")
}

// needImageTier is the tier with the disk image named by the environment
// variable imageEnv served over HTTP from loopback.
func needImageTier(t *testing.T, imageEnv, hint string) guestTier {
	t.Helper()
	var g guestTier
	g.socket, g.pool, g.network = needLibvirt(t)
	img := os.Getenv(imageEnv)
	testgate.NeedFile(t, img, hint)
	g.gateway = os.Getenv("KVM_TEST_GATEWAY")
	testgate.Need(t, g.gateway != "", "KVM_TEST_GATEWAY (the host's address on the guest network) is set by the make target")
	imgSrv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { http.ServeFile(w, r, img) })}
	il, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = imgSrv.Serve(il) }()
	t.Cleanup(func() { _ = imgSrv.Close() })
	g.imageAddr = il.Addr()
	return g
}

// config is the kvm-agent configuration of entry on the tier: TCG, the
// guest image under key guest, one tiny profile.
func (g guestTier) config(t *testing.T, entry string) *config.Config {
	t.Helper()
	return g.parseConfig(t, entry, fmt.Sprintf(`images:
  guest: {url: "http://%s/guest.qcow2", format: qcow2, firmware: bios}
profiles:
  tiny: {vcpus: 1, memoryMiB: 256, diskGiB: 1}
`, g.imageAddr))
}

// parseConfig is the kvm-agent configuration of entry on the tier (its
// libvirt socket, pool and network, TCG) followed by rest: the images and
// profiles, and whatever else a test sets.
func (g guestTier) parseConfig(t *testing.T, entry, rest string) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(fmt.Sprintf(`
entry: %s
target: ci
libvirt: {socket: %s}
pool: %s
network: %s
domainType: qemu
`, entry, g.socket, g.pool, g.network) + rest))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// agentOn runs a kvm-agent for entry with the tier's guest configuration
// (commands may take 5 minutes) on a NATS server of its own, and returns
// the connection to that server and the agent's stack.
func (g guestTier) agentOn(t *testing.T, entry string) (*bus.Conn, *kvm.Stack) {
	t.Helper()
	conn := bustest.Start(t)
	stack := startAgent(t, conn, g.config(t, entry), kvm.Options{}, agent.Config{CommandTimeout: 5 * time.Minute, WatchInterval: time.Second})
	return conn, stack
}
