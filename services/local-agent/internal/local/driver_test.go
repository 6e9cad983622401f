package local

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
)

func readState(t *testing.T, d *Driver, name string) *state {
	t.Helper()
	s, err := d.states.read(name)
	if err != nil {
		t.Fatalf("state of %s: %v", name, err)
	}
	return s
}

// createAllowing creates the proxy proxyID on d with an egress policy that
// allows the origin o, failing the test if Create fails.
func createAllowing(ctx context.Context, t *testing.T, d *Driver, o *httptest.Server, proxyID string) (agent.Spec, agent.Instance) {
	t.Helper()
	sp := withEgress(spec(proxyID), allowing(t, o))
	inst, err := d.Create(ctx, sp)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	return sp, inst
}

func TestCreateServesAndIsIdempotent(t *testing.T) {
	o := origin(t)
	d := newDriver(t, Config{})
	ctx := ctxT(t)
	sp, inst := createAllowing(ctx, t, d, o, "demo-aaaa")
	if inst.State != agent.StateRunning || inst.Marker != sp.Marker() || inst.Name != sp.Name {
		t.Fatalf("Create = %+v, want running %s with marker %+v", inst, sp.Name, sp.Marker())
	}
	host, _, _ := net.SplitHostPort(inst.Address)
	if host != "127.0.0.1" {
		t.Errorf("address %s, want host 127.0.0.1", inst.Address)
	}
	wantServes(t, inst.Address, o)
	first := readState(t, d, sp.Name)

	again, err := d.Create(ctx, sp)
	if err != nil {
		t.Fatalf("second Create: %v", err)
	}
	second := readState(t, d, sp.Name)
	if again.Address != inst.Address || second.PID != first.PID {
		t.Fatalf("second Create: address %s pid %d, want %s pid %d", again.Address, second.PID, inst.Address, first.PID)
	}
	if leaders, _ := markedProcesses(d.states.path(sp.Name)); len(leaders) != 1 || leaders[0] != first.PID {
		t.Fatalf("proxy processes %v, want exactly [%d]", leaders, first.PID)
	}
}

func TestRestartedDriverFindsProxies(t *testing.T) {
	o := origin(t)
	d1 := newDriver(t, Config{})
	ctx := ctxT(t)
	sp, inst := createAllowing(ctx, t, d1, o, "demo-bbbb")
	d2, err := New(d1.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	list, err := d2.List(ctx)
	if err != nil || len(list) != 1 || list[0].Name != sp.Name || list[0].Marker != sp.Marker() || list[0].Address != inst.Address {
		t.Fatalf("List after restart = %+v, %v; want one %s with marker %+v at %s", list, err, sp.Name, sp.Marker(), inst.Address)
	}
	got, err := d2.Get(ctx, agent.Ref{ProxyID: sp.ProxyID, Name: sp.Name})
	if err != nil || got.State != agent.StateRunning || got.Address != inst.Address {
		t.Fatalf("Get after restart = %+v, %v; want running at %s", got, err, inst.Address)
	}
	wantServes(t, got.Address, o)
}

func TestDeleteStopsProcessAndRemovesState(t *testing.T) {
	d := newDriver(t, Config{})
	ctx := ctxT(t)
	sp := spec("demo-cccc")
	if _, err := d.Create(ctx, sp); err != nil {
		t.Fatalf("Create: %v", err)
	}
	pid := readState(t, d, sp.Name).PID
	ref := agent.Ref{ProxyID: sp.ProxyID, Name: sp.Name}
	if err := d.Delete(ctx, ref); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if !processGone(pid) {
		t.Fatalf("process %d still runs after Delete", pid)
	}
	for _, p := range []string{d.states.path(sp.Name), d.states.instanceDir(sp.Name)} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s still exists after Delete (err %v)", p, err)
		}
	}
}

func TestCreateRestartsKilledProxyOnSamePort(t *testing.T) {
	o := origin(t)
	d := newDriver(t, Config{})
	ctx := ctxT(t)
	sp, inst := createAllowing(ctx, t, d, o, "demo-dddd")
	old := readState(t, d, sp.Name).PID
	killProxy(t, old)
	got, err := d.Get(ctx, agent.Ref{Name: sp.Name})
	if err != nil || got.State != agent.StateTerminated {
		t.Fatalf("Get of killed proxy = %+v, %v; want terminated", got, err)
	}
	again, err := d.Create(ctx, sp)
	if err != nil {
		t.Fatalf("Create after kill: %v", err)
	}
	if again.Address != inst.Address {
		t.Fatalf("restarted on %s, want the same address %s", again.Address, inst.Address)
	}
	if pid := readState(t, d, sp.Name).PID; pid == old || processGone(pid) {
		t.Fatalf("state pid %d after restart (old %d), want a new live process", pid, old)
	}
	wantServes(t, again.Address, o)
}

// A crash between starting the process and recording its pid leaves state
// without a pid and a running process: Create must adopt it, not start a
// second one.
func TestCreateAdoptsProcessWhosePidWasNotRecorded(t *testing.T) {
	d := newDriver(t, Config{})
	ctx := ctxT(t)
	sp := spec("demo-eeee")
	s, ln, err := d.allocate(sp)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	l, err := d.prepare(s, nil, egress.Policy{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.handOver(ln); err != nil {
		t.Fatal(err)
	}
	pid, _, err := start(l) // and "crash": the pid is never written
	if err != nil {
		t.Fatal(err)
	}
	d2, err := New(d.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := d2.Get(ctx, agent.Ref{Name: sp.Name})
	if err != nil || got.State == agent.StateTerminated {
		t.Fatalf("Get = %+v, %v; want the unrecorded process found", got, err)
	}
	if recorded := readState(t, d, sp.Name).PID; recorded != pid {
		t.Fatalf("state pid after Get = %d, want the found %d", recorded, pid)
	}
	if _, err := d2.Create(ctx, sp); err != nil {
		t.Fatalf("Create: %v", err)
	}
	leaders, _ := markedProcesses(d.states.path(sp.Name))
	if len(leaders) != 1 || leaders[0] != pid || readState(t, d, sp.Name).PID != pid {
		t.Fatalf("processes %v, state pid %d; want exactly the adopted %d", leaders, readState(t, d, sp.Name).PID, pid)
	}
}

// foreignFiles are files of a state directory that are not proxyfleet
// state, squatter (a JSON file named as an instance) among them.
func foreignFiles(squatter string) map[string]string {
	return map[string]string{
		squatter + ".json": `{"hello":"world"}`,
		"notes.txt":        "keep me",
		"px-other.json":    `{"kind":"something-else","name":"px-other","marker":{"proxyID":"x"}}`,
		"broken.json":      `{`,
		".hidden.json":     `{}`,
		"UPPER-CASE.json":  `{}`,
	}
}

func writeFiles(t *testing.T, dir string, files map[string]string) {
	t.Helper()
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// The driver neither lists foreign files (the conformance suite's
// ListOnlyMarked) nor creates over or deletes one.
func TestForeignFilesAreUntouched(t *testing.T) {
	dir := t.TempDir()
	squatted := spec("demo-ffff")
	foreign := foreignFiles(squatted.Name)
	writeFiles(t, dir, foreign)
	d := newDriver(t, Config{StateDir: dir})
	ctx := ctxT(t)
	if _, err := d.Create(ctx, spec("demo-gggg")); err != nil {
		t.Fatalf("Create: %v", err)
	}
	if _, err := d.Create(ctx, squatted); !errors.Is(err, agent.ErrPermanent) {
		t.Errorf("Create over a foreign file: %v, want ErrPermanent", err)
	}
	if err := d.Delete(ctx, agent.Ref{Name: squatted.Name}); !errors.Is(err, agent.ErrPermanent) {
		t.Errorf("Delete of a foreign file: %v, want ErrPermanent", err)
	}
	for name, content := range foreign {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil || string(b) != content {
			t.Errorf("%s changed: %q, %v; want %q", name, b, err, content)
		}
	}
}

func TestQuota(t *testing.T) {
	ctx := ctxT(t)
	t.Run("capacity", func(t *testing.T) {
		d := newDriver(t, Config{Capacity: 1})
		if _, err := d.Create(ctx, spec("demo-q1")); err != nil {
			t.Fatalf("first Create: %v", err)
		}
		if _, err := d.Create(ctx, spec("demo-q2")); !errors.Is(err, agent.ErrQuotaExceeded) {
			t.Fatalf("second Create: %v, want ErrQuotaExceeded", err)
		}
		if _, err := d.Create(ctx, spec("demo-q1")); err != nil {
			t.Fatalf("Create of the existing one at capacity: %v", err)
		}
	})
	t.Run("ports", func(t *testing.T) {
		busy, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer busy.Close()
		port := busy.Addr().(*net.TCPAddr).Port
		d := newDriver(t, Config{Ports: PortRange{First: port, Last: port}})
		if _, err := d.Create(ctx, spec("demo-q3")); !errors.Is(err, agent.ErrQuotaExceeded) {
			t.Fatalf("Create with the only port taken: %v, want ErrQuotaExceeded", err)
		}
		if list, _ := d.List(ctx); len(list) != 0 {
			t.Fatalf("List = %+v, want nothing left behind", list)
		}
	})
}

func TestAuthAndSourceAddresses(t *testing.T) {
	o := origin(t)
	d := newDriver(t, Config{SourceAddrs: []string{"127.0.0.2", "127.0.0.3"}})
	ctx := ctxT(t)
	sp := spec("demo-auth")
	sp.Egress = allowing(t, o)
	sp.Auth = &events.ProxyAuth{Username: "crawler", Password: "s3cret"}
	a, err := d.Create(ctx, sp)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	if code, _, _ := getVia(t, a.Address, "", "", o.URL+"/"); code != http.StatusProxyAuthRequired {
		t.Errorf("without credentials: %d, want 407", code)
	}
	if code, _, _ := getVia(t, a.Address, "crawler", "wrong", o.URL+"/"); code != http.StatusProxyAuthRequired {
		t.Errorf("wrong password: %d, want 407", code)
	}
	code, _, remote := getVia(t, a.Address, "crawler", "s3cret", o.URL+"/")
	if code != http.StatusOK || remote != "127.0.0.2" {
		t.Errorf("with credentials: %d from %s, want 200 from 127.0.0.2", code, remote)
	}
	authFile := filepath.Join(d.states.instanceDir(sp.Name), fileAuth)
	if fi, err := os.Stat(authFile); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("auth file %s: %v, %v; want mode 0600", authFile, fi, err)
	}
	raw, _ := os.ReadFile(d.states.path(sp.Name))
	if strings.Contains(string(raw), "s3cret") {
		t.Errorf("state file holds the password: %s", raw)
	}
	b, err := d.Create(ctx, withEgress(spec("demo-noauth"), allowing(t, o)))
	if err != nil {
		t.Fatalf("second Create: %v", err)
	}
	if _, _, remote := getVia(t, b.Address, "", "", o.URL+"/"); remote != "127.0.0.3" {
		t.Errorf("second proxy sends from %s, want the least used 127.0.0.3", remote)
	}
}

func TestCheck(t *testing.T) {
	d := newDriver(t, Config{Capacity: 2})
	ctx := ctxT(t)
	got := map[string]agent.Verdict{}
	for _, v := range d.Check(ctx) {
		got[v.Check] = v
	}
	for _, name := range []string{"state-dir", "ports", "proxy-binary"} {
		if v, ok := got[name]; !ok || !v.OK {
			t.Errorf("verdict %s = %+v, want ok", name, v)
		}
	}
	for _, id := range []string{"demo-c1", "demo-c2"} {
		if _, err := d.Create(ctx, spec(id)); err != nil {
			t.Fatal(err)
		}
	}
	for _, v := range d.Check(ctx) {
		if v.Check == "ports" && v.OK {
			t.Errorf("ports verdict at capacity = %+v, want not ok", v)
		}
	}
}

func TestConfigProblems(t *testing.T) {
	good := Config{Ports: PortRange{20000, 20010}, StateDir: "x", Executable: "/bin/true"}
	cases := []struct {
		name   string
		mutate func(*Config)
		want   int
	}{
		{"good", func(*Config) {}, 0},
		{"bad bind", func(c *Config) { c.Bind = "localhost" }, 1},
		{"bad and duplicate sources", func(c *Config) { c.SourceAddrs = []string{"1.2.3.4", "x", "1.2.3.4"} }, 2},
		{"no state dir", func(c *Config) { c.StateDir = "" }, 1},
		{"negative capacity", func(c *Config) { c.Capacity = -1 }, 1},
		{"missing squid", func(c *Config) { c.Squid = "/nonexistent/squid" }, 1},
		{"no executable", func(c *Config) { c.Executable = "" }, 1},
		{"kernel ports", func(c *Config) { c.Ports, c.Capacity = PortRange{}, 5 }, 0},
		{"kernel ports without capacity", func(c *Config) { c.Ports = PortRange{} }, 1},
		{"kernel ports with squid", func(c *Config) { c.Ports, c.Capacity, c.Squid = PortRange{}, 5, "/bin/true" }, 1},
	}
	for _, tc := range cases {
		c := good
		tc.mutate(&c)
		if got := c.Problems(); len(got) != tc.want {
			t.Errorf("%s: problems %v, want %d", tc.name, got, tc.want)
		}
	}
	if _, err := New(Config{StateDir: t.TempDir()}, nil); !errors.Is(err, agent.ErrPermanent) {
		t.Errorf("New with a bad config: %v, want ErrPermanent", err)
	}
}

func TestParsePortRange(t *testing.T) {
	cases := []struct {
		in   string
		want PortRange
		ok   bool
	}{
		{"20000-20999", PortRange{20000, 20999}, true},
		{"0", PortRange{}, true},
		{"80-80", PortRange{80, 80}, true},
		{"20-10", PortRange{}, false},
		{"0-10", PortRange{}, false},
		{"1-70000", PortRange{}, false},
		{"20000", PortRange{}, false},
		{"a-b", PortRange{}, false},
	}
	for _, tc := range cases {
		got, err := ParsePortRange(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("ParsePortRange(%q) = %v, %v; want %v ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

// When another program took the port of a dead proxy, the restart moves
// the proxy to a free port instead of failing forever.
func TestRestartMovesOffATakenPort(t *testing.T) {
	o := origin(t)
	d := newDriver(t, Config{})
	ctx := ctxT(t)
	sp, inst := createAllowing(ctx, t, d, o, "demo-moved")
	killProxy(t, readState(t, d, sp.Name).PID)
	var squatter net.Listener
	eventually(t, "the old port to be free", func() bool {
		ln, err := net.Listen("tcp", inst.Address)
		squatter = ln
		return err == nil
	})
	defer squatter.Close()
	again, err := d.Create(ctx, sp)
	if err != nil {
		t.Fatalf("Create with the port taken: %v", err)
	}
	if again.Address == inst.Address {
		t.Fatalf("restarted on the taken address %s", again.Address)
	}
	wantServes(t, again.Address, o)
}

// With ports 0 the kernel chooses each proxy's port, and the proxy serves
// on the socket the driver bound: two proxies, two ports, both serving.
func TestKernelChoosesPorts(t *testing.T) {
	o := origin(t)
	d := newDriver(t, Config{Ports: PortRange{}, Capacity: 2})
	ctx := ctxT(t)
	_, a := createAllowing(ctx, t, d, o, "demo-kern1")
	_, b := createAllowing(ctx, t, d, o, "demo-kern2")
	if a.Address == b.Address {
		t.Fatalf("two proxies on %s", a.Address)
	}
	for _, inst := range []agent.Instance{a, b} {
		if _, port, _ := net.SplitHostPort(inst.Address); port == "0" {
			t.Fatalf("address %s: want the port the kernel chose", inst.Address)
		}
		wantServes(t, inst.Address, o)
	}
	// The proxy serves on the socket it inherited rather than binding
	// the port again.
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", readState(t, d, spec("demo-kern1").Name).PID))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(cmdline, []byte("--listen-fd\x003")) {
		t.Errorf("proxy command line %q: want --listen-fd 3", cmdline)
	}
}
