//go:build e2e

package integration

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/cloudinit/seedtest"
	"proxyfleet/pkg/events"
	"proxyfleet/services/kvm-agent/internal/kvm"
)

// The marks the guests print on their serial console.
const (
	markBootstrap   = "proxyfleet: guest-agent bootstrap done"
	markOperatorRun = "proxyfleet-operator-runcmd-done"
	markScriptRun   = "proxyfleet-script-user-data-done"
)

// scriptUserData is a user-data that is not a cloud-config: a shell script
// that opens the image's Squid to the guest network.
const scriptUserData = `#!/bin/sh
cat >/etc/squid/conf.d/script.conf <<'EOF'
visible_hostname script-proxy
http_access allow all
cache deny all
EOF
systemctl restart squid
echo ` + markScriptRun + ` >/dev/console
`

// TestCloudImageProxies boots the Debian cloud image built by
// scripts/build-cloud-image.sh (make cloud-image) through the product's
// path: the image served over HTTP with its sha256, the kvm-agent's cache
// upload, overlay, seed and domain under TCG, cloud-init in the guest, the
// guest agent reporting the address, and the health service probing
// through Squid. Three user-data kinds boot in parallel:
//
//   - the default Squid cloud-config with basic auth, for a pool applied to
//     the planner: a request without credentials gets 407, with them 200;
//   - the operator's cloud-config (own packages and runcmd, the vendor-data
//     merge trap), whose seed read back from libvirt is the golden one;
//   - a shell script: vendor-data still bootstraps the guest agent.
//
// The vendor-data script's console mark in each domain's serial log proves
// it ran (the image's qemu-guest-agent would start without it).
func TestCloudImageProxies(t *testing.T) {
	g := needImageTier(t, "KVM_TEST_CLOUD_IMAGE", "build it with make cloud-image (make e2e-kvm-cloud does)")
	imgPath := os.Getenv("KVM_TEST_CLOUD_IMAGE")
	sum := fileSHA256(t, imgPath)

	// The site the test fetches through the proxies.
	const greeting = "hello through squid"
	sl := serveGreeting(t, g.gateway, greeting)
	logDir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	// fleet runs a kvm-agent for a new entry, the health service with its
	// echo endpoint on echo and, with planner, the planner, on a NATS server
	// of their own: the planner retires proxies of pools it does not know,
	// so the cases without a pool get a fleet without one.
	fleet := func(echo string, planner bool) (entry string, conn *bus.Conn) {
		entry = randomEntry(t)
		endpoints := []netip.AddrPort{netip.MustParseAddrPort(echo), netip.MustParseAddrPort(sl.Addr().String())}
		cfg := g.parseConfig(t, entry, fmt.Sprintf(`serialLogDir: %s
images:
  debian12: {url: "http://%s/debian-12-cloud.qcow2", sha256: %s, format: qcow2, firmware: uefi}
profiles:
  small: {vcpus: 1, memoryMiB: 768, diskGiB: 3}
`, logDir, g.imageAddr, sum))
		conn = bustest.Start(t)
		startAgent(t, conn, cfg, kvm.Options{}, agent.Config{CommandTimeout: 10 * time.Minute,
			WatchInterval: time.Second, EgressEndpoints: endpoints})
		startHealthEcho(t, conn.ClientURL(), echo)
		if planner {
			startPlanner(t, conn.ClientURL())
		}
		return entry, conn
	}
	operatorName := seedtest.OperatorInstance
	scriptName := events.InstanceName("cloud-script")
	// Health's echo endpoint for the pool-less cases is on 443: Debian's
	// stock squid.conf, which they keep, refuses CONNECT to other ports.
	entry, conn := fleet(net.JoinHostPort(g.gateway, "443"), false)
	cleanupEntry(t, g.pool, entry, operatorName, scriptName)
	el, err := net.Listen("tcp", net.JoinHostPort(g.gateway, "0"))
	if err != nil {
		t.Fatal(err)
	}
	echoA := el.Addr().String()
	el.Close()
	entryA, connA := fleet(echoA, true)
	cleanupEntry(t, g.pool, entryA)
	storeA := bus.NewEventStore(connA, "e2e", nil)
	store := bus.NewEventStore(conn, "e2e", nil)
	// The decisions of the cases without a pool are recorded as the
	// planner's.
	decisions := bus.NewEventStore(conn, events.SourcePlanner, nil)
	serialLog := func(name string) string {
		b, _ := os.ReadFile(filepath.Join(logDir, name+".log"))
		return string(b)
	}
	// The marks are printed by cloud-final (the vendor-data's bootstrap,
	// the user-data's runcmd), which ends after the image's Squid first
	// answers: 2 minutes after ready on a quiet machine, more than 4 in a
	// CI run that booted the three guests beside two other lanes. They get
	// the boot's own deadline.
	wantMarks := func(t *testing.T, name string, marks ...string) {
		t.Helper()
		for _, m := range marks {
			eventually(t, fmt.Sprintf("%q on %s's serial console", m, name), 12*time.Minute, func() bool {
				return strings.Contains(serialLog(name), m)
			})
		}
	}
	// create records the decision as the planner would (so health probes
	// the proxy) and sends the create command.
	create := func(t *testing.T, proxy, pool string, userData []byte) {
		t.Helper()
		name := events.InstanceName(proxy)
		requested := events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: pool, Entry: entry, Target: "ci", Instance: name, Revision: 1, Port: 3128}}
		if _, err := decisions.Append(ctx, events.AggregateProxy, proxy, events.ProxyRequested,
			events.ProxyEventID(proxy, events.ProxyRequested, 1), requested, &bus.Expect{Seq: 0}); err != nil {
			t.Fatal(err)
		}
		cmd := events.CreateCommand{
			ProxyID:   proxy,
			ProxySpec: events.ProxySpec{Pool: pool, Entry: entry, Target: "ci", Instance: name, Port: 3128, Image: "debian12", Profile: "small"},
			Attempt:   1,
			UserData:  userData,
		}
		if _, err := bus.PublishCreate(ctx, conn, "e2e", cmd, 0); err != nil {
			t.Fatal(err)
		}
	}

	t.Run("default-cloud-config-auth", func(t *testing.T) {
		t.Parallel()
		const pool = "cloudauth"
		creds := url.UserPassword("crawler", "s3cret-through-squid")
		applyPool(t, connA, events.PoolSpec{Name: pool, Provider: entryA, Size: 1, Image: "debian12",
			Profile: "small", Port: 3128, Auth: &events.ProxyAuth{Username: "crawler", Password: "s3cret-through-squid"}})
		var proxy string
		eventually(t, "the planner's proxy", time.Minute, func() bool {
			for _, kind := range []string{events.ProxyRequested, events.ProxyProvisioning, events.ProxyRunning, events.ProxyReady, events.ProxyUnhealthy} {
				if ids := proxiesIn(t, storeA, pool, kind); len(ids) == 1 {
					proxy = ids[0]
				}
			}
			return proxy != ""
		})
		name := events.InstanceName(proxy)
		// The pool is deleted (the planner has the agent delete its proxy)
		// while the other cases still run; the entry's base image stays.
		t.Cleanup(func() {
			deletePool(t, connA, pool)
			eventually(t, "the pool's proxy deleted", 2*time.Minute, func() bool {
				last, err := storeA.Last(ctx, events.AggregateProxy, proxy)
				return err == nil && last != nil && last.Kind == events.ProxyDeleted
			})
		})
		running, ready := waitReady(t, ctx, storeA, proxy)
		logFigures(t, ctx, "default cloud-config, basic auth (planner)", storeA, proxy, running)
		// Health probed it, failing, for minutes while cloud-init ran;
		// with the pool's default unhealthyAfter (2 min) nothing may have
		// called it unhealthy or replaced it: it was never ready.
		if e, _ := storeA.LastOf(ctx, events.AggregateProxy, proxy, events.ProxyUnhealthy); e != nil {
			t.Errorf("the booting proxy was called unhealthy: %s", e.Data)
		}
		if n := poolMembers(t, storeA, pool); n != 1 {
			t.Errorf("pool %s had %d proxies requested while its one proxy booted, want 1", pool, n)
		}

		target := "http://" + sl.Addr().String() + "/"
		get := func(u *url.URL) (int, string) {
			c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(u)}, Timeout: 15 * time.Second}
			resp, err := c.Get(target)
			if err != nil {
				t.Fatalf("GET %s through %s: %v", target, running.Address, err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, string(b)
		}
		without, _ := get(&url.URL{Scheme: "http", Host: running.Address})
		if without != http.StatusProxyAuthRequired {
			t.Errorf("without credentials: %d; want 407", without)
		}
		with, body := get(&url.URL{Scheme: "http", Host: running.Address, User: creds})
		if with != http.StatusOK || body != greeting {
			t.Errorf("with credentials: %d %q; want 200 %q", with, body, greeting)
		}
		t.Logf("default cloud-config: without credentials %d, with credentials %d (egress %s)", without, with, ready.EgressIP)
		wantMarks(t, name, markBootstrap)
	})

	t.Run("operator-cloud-config", func(t *testing.T) {
		t.Parallel()
		_, iso := seedtest.OperatorSeed(t)
		create(t, seedtest.OperatorProxyID, "operator", seedtest.OperatorUserData(t))
		running, _ := waitReady(t, ctx, store, seedtest.OperatorProxyID)
		logFigures(t, ctx, "operator cloud-config", store, seedtest.OperatorProxyID, running)
		wantMarks(t, operatorName, markBootstrap, markOperatorRun)

		// The seed that booted, read back from libvirt, is the golden one
		// the Proxmox and GCE tests compare their uploads with.
		f := filepath.Join(t.TempDir(), "seed.iso")
		if out, err := virsh(t, "vol-download", "--pool", g.pool, kvm.SeedName(operatorName), f); err != nil {
			t.Fatalf("vol-download: %v: %s", err, out)
		}
		if got, want := fileSHA256(t, f), seedtest.SHA256(iso); got != want {
			t.Fatalf("booted seed sha256 %s, want the golden %s", got, want)
		}
		t.Logf("operator cloud-config: booted seed sha256 %s is the golden operator seed", seedtest.SHA256(iso))
	})

	t.Run("shell-script-user-data", func(t *testing.T) {
		t.Parallel()
		create(t, "cloud-script", "script", []byte(scriptUserData))
		running, _ := waitReady(t, ctx, store, "cloud-script")
		logFigures(t, ctx, "shell-script user-data", store, "cloud-script", running)
		wantMarks(t, scriptName, markBootstrap, markScriptRun)
	})
}

// waitReady waits for the proxy's running event with an address (failing
// on a failed event) and then for health's ready event.
func waitReady(t *testing.T, ctx context.Context, store *bus.EventStore, proxy string) (events.ProxyRunningData, events.ProxyReadyData) {
	t.Helper()
	var running events.ProxyRunningData
	eventually(t, proxy+"'s running event", 12*time.Minute, func() bool {
		if f, _ := store.LastOf(ctx, events.AggregateProxy, proxy, events.ProxyFailed); f != nil {
			t.Fatalf("%s failed: %s", proxy, f.Data)
		}
		e, err := store.LastOf(ctx, events.AggregateProxy, proxy, events.ProxyRunning)
		return err == nil && e != nil && e.DecodeData(&running) == nil && running.Address != ""
	})
	var ready events.ProxyReadyData
	eventually(t, proxy+"'s ready event (health through its Squid)", 12*time.Minute, func() bool {
		e, err := store.LastOf(ctx, events.AggregateProxy, proxy, events.ProxyReady)
		return err == nil && e != nil && e.DecodeData(&ready) == nil
	})
	return running, ready
}

// logFigures logs command → running and command → ready from the event
// times: the create command follows the requested event.
func logFigures(t *testing.T, ctx context.Context, what string, store *bus.EventStore, proxy string, running events.ProxyRunningData) {
	t.Helper()
	at := func(kind string) time.Time {
		e, err := store.LastOf(ctx, events.AggregateProxy, proxy, kind)
		if err != nil || e == nil {
			t.Fatalf("%s has no %s event: %v", proxy, kind, err)
		}
		return e.Time
	}
	req := at(events.ProxyRequested)
	t.Logf("%s: command → running %s (address %s), command → ready %s", what,
		at(events.ProxyRunning).Sub(req).Round(time.Second), running.Address, at(events.ProxyReady).Sub(req).Round(time.Second))
}

// poolMembers counts the proxies ever requested for pool.
func poolMembers(t *testing.T, store *bus.EventStore, pool string) int {
	t.Helper()
	n := 0
	err := store.Replay(context.Background(), 0, func(e bus.Event) error {
		var r events.ProxyRequestedData
		if e.Aggregate == events.AggregateProxy && e.Kind == events.ProxyRequested && e.DecodeData(&r) == nil && r.Pool == pool {
			n++
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}
