package local

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testgate"
)

// EnvSquid names the squid binary the Squid tests run; `make test-squid`
// installs Debian's squid and sets it. Without it these tests skip: they
// belong to the squid tier, where PROXYFLEET_REQUIRE_INTEGRATION=1 turns a
// missing binary into a failure.
const EnvSquid = "PROXYFLEET_SQUID"

// squidDriver returns a squid-mode driver, or skips the test outside the
// squid tier.
func squidDriver(t *testing.T, cfg Config) *Driver {
	t.Helper()
	path := os.Getenv(EnvSquid)
	if path == "" {
		t.Skipf("squid tier: set %s to a squid binary (make test-squid)", EnvSquid)
	}
	testgate.NeedFile(t, path, "install Debian's squid (make squid-install)")
	cfg.Squid = path
	// Squid started as root drops to its own user, which must reach the
	// instance directory: open up the test's temp directories for traversal.
	cfg.StateDir = t.TempDir()
	for _, dir := range []string{cfg.StateDir, filepath.Dir(cfg.StateDir)} {
		if err := os.Chmod(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return newDriver(t, cfg)
}

func TestSquidAuthConnectAndSourceAddress(t *testing.T) {
	d := squidDriver(t, Config{SourceAddrs: []string{"127.0.0.2"}})
	o := origin(t)
	ctx := ctxT(t)
	sp := spec("demo-squid1")
	tlsOrigin := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "tunnel "+r.URL.Path)
	}))
	t.Cleanup(tlsOrigin.Close)
	sp.Egress = allowing(t, o, tlsOrigin)
	sp.Auth = &events.ProxyAuth{Username: "crawler", Password: "sq-pass"}
	inst, err := d.Create(ctx, sp)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	if exe, err := os.Readlink(filepath.Join("/proc", strconv.Itoa(readState(t, d, sp.Name).PID), "exe")); err != nil || exe != d.cfg.Squid {
		t.Fatalf("proxy process runs %q (%v), want %s", exe, err, d.cfg.Squid)
	}
	if code, _, _ := getVia(t, inst.Address, "", "", o.URL+"/"); code != http.StatusProxyAuthRequired {
		t.Errorf("without credentials: %d, want 407", code)
	}
	if code, _, _ := getVia(t, inst.Address, "crawler", "wrong", o.URL+"/"); code != http.StatusProxyAuthRequired {
		t.Errorf("wrong password: %d, want 407", code)
	}
	code, body, remote := getVia(t, inst.Address, "crawler", "sq-pass", o.URL+"/sq")
	if code != http.StatusOK || body != "hello /sq" || remote != "127.0.0.2" {
		t.Errorf("with credentials: %d %q from %s, want 200 %q from 127.0.0.2", code, body, remote, "hello /sq")
	}

	pu := &url.URL{Scheme: "http", Host: inst.Address, User: url.UserPassword("crawler", "sq-pass")}
	tr := &http.Transport{Proxy: http.ProxyURL(pu), TLSClientConfig: tlsOrigin.Client().Transport.(*http.Transport).TLSClientConfig.Clone()}
	resp, err := (&http.Client{Transport: tr}).Get(tlsOrigin.URL + "/t")
	if err != nil {
		t.Fatalf("CONNECT through squid: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "tunnel /t" {
		t.Errorf("CONNECT through squid: %q, want %q", b, "tunnel /t")
	}

	pid := readState(t, d, sp.Name).PID
	statePath := d.states.path(sp.Name)

	for _, v := range d.Check(ctx) {
		if !v.OK {
			t.Errorf("check %s failed: %s", v.Check, v.Detail)
		}
	}
	if err := d.Delete(ctx, agent.Ref{ProxyID: sp.ProxyID, Name: sp.Name}); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if _, all := markedProcesses(statePath); !processGone(pid) || len(all) != 0 {
		t.Fatalf("after Delete: squid %d gone=%v, marked processes %v; want none", pid, processGone(pid), all)
	}
}

func TestSquidRestartAfterKill(t *testing.T) {
	d := squidDriver(t, Config{})
	o := origin(t)
	ctx := ctxT(t)
	sp := spec("demo-squid2")
	sp.Egress = allowing(t, o)
	inst, err := d.Create(ctx, sp)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	wantServes(t, inst.Address, o)
	old := readState(t, d, sp.Name).PID
	if err := syscall.Kill(-old, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	eventually(t, "killed squid to exit", func() bool { return processGone(old) })
	again, err := d.Create(ctx, sp)
	if err != nil {
		t.Fatalf("Create after kill: %v", err)
	}
	if again.Address != inst.Address {
		t.Errorf("restarted on %s, want %s", again.Address, inst.Address)
	}
	wantServes(t, again.Address, o)
}

func TestSquidThroughRuntime(t *testing.T) {
	d := squidDriver(t, Config{})
	conn := bustest.Start(t)
	o := origin(t)
	runAgent(t, conn, d, endpoint(t, o))
	store := bus.NewEventStore(conn, "test", nil)
	ctx := ctxT(t)
	cmd := createCommand("demo-squid3", &events.ProxyAuth{Username: "u", Password: "p"})
	addr := createRunning(ctx, t, conn, store, cmd)
	if code, body, _ := getVia(t, addr, "u", "p", o.URL+"/rt"); code != http.StatusOK || body != "hello /rt" {
		t.Fatalf("GET via squid %s: %d %q, want 200 %q", addr, code, body, "hello /rt")
	}
	pid := readState(t, d, cmd.Instance).PID
	deleteProxy(ctx, t, conn, store, cmd)
	if !processGone(pid) {
		t.Fatalf("squid %d still runs after the deleted event", pid)
	}
}

func TestSquidUnreachableStateDirIsPermanent(t *testing.T) {
	d := squidDriver(t, Config{})
	if os.Geteuid() != 0 {
		t.Skip("squid keeps the caller's user unless started as root")
	}
	if err := os.Chmod(filepath.Dir(d.cfg.StateDir), 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := New(d.cfg, nil); !errors.Is(err, agent.ErrPermanent) {
		t.Errorf("New with a state dir squid cannot reach: %v, want ErrPermanent", err)
	}
	_, err := d.Create(ctxT(t), spec("demo-squid4"))
	if !errors.Is(err, agent.ErrPermanent) {
		t.Fatalf("Create with a state dir squid cannot reach: %v, want ErrPermanent", err)
	}
	for _, v := range d.Check(ctxT(t)) {
		if v.Check == "squid-access" && v.OK {
			t.Errorf("squid-access verdict %+v, want not ok", v)
		}
	}
}
