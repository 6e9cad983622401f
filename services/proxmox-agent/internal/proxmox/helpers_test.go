package proxmox_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
	"proxyfleet/services/proxmox-agent/internal/config"
	"proxyfleet/services/proxmox-agent/internal/proxmox"
	"proxyfleet/services/proxmox-agent/internal/pve"
	"proxyfleet/services/proxmox-agent/internal/pve/pvetest"
)

const (
	entry    = "pve-home"
	node     = "pve1"
	template = 9000
)

// env is one fake cluster, one NATS server and the config of an agent.
type env struct {
	t     *testing.T
	fake  *pvetest.Server
	conn  *bus.Conn
	kv    jetstream.KeyValue
	cfg   *config.Config
	token string
}

func newEnv(t *testing.T, opts pvetest.Options) *env {
	t.Helper()
	fake := pvetest.Start(t, opts)
	fake.AddTemplate(node, template, "debian-13-tmpl")
	conn := bustest.Start(t)
	kv, err := conn.JS.KeyValue(context.Background(), bus.BucketVMIDs)
	if err != nil {
		t.Fatal(err)
	}
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(fake.Token()+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Parse([]byte(`
entry: ` + entry + `
apiURL: ` + fake.URL + `
tokenFile: ` + tokenFile + `
fingerprint: "` + pve.FormatFingerprint(fake.Fingerprint()) + `"
nodes: [` + node + `]
templates: {debian-13: 9000}
seedsStorage: proxy-seeds
bridge: vmbr0
vlanTag: 4
profiles: {small: {cores: 2, memoryMiB: 768}}
taskPollInterval: 2ms
`))
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, fake: fake, conn: conn, kv: kv, cfg: cfg, token: tokenFile}
}

// driver returns a new driver (as a fresh agent process would build one).
func (e *env) driver() *proxmox.Driver {
	e.t.Helper()
	c, err := pve.New(pve.Config{URL: e.cfg.APIURL, TokenFile: e.cfg.TokenFile, Fingerprint: e.cfg.Fingerprint,
		TaskPollInterval: time.Duration(e.cfg.TaskPollInterval)})
	if err != nil {
		e.t.Fatal(err)
	}
	d, err := proxmox.New(proxmox.Options{Config: e.cfg, Node: node, Client: c, VMIDs: e.kv, PollInterval: 5 * time.Millisecond})
	if err != nil {
		e.t.Fatal(err)
	}
	return d
}

func spec(proxy string) agent.Spec {
	return agent.Spec{ProxyID: proxy, Pool: "web", Entry: entry, Target: node, Name: events.InstanceName(proxy),
		Attempt: 1, Image: "debian-13", Profile: "small", Port: 3128, Auth: &events.ProxyAuth{Username: "u", Password: "secret-pw"}}
}

// prepared reserves a VMID for s with d and returns s carrying it as its
// provider ID, as the agent runtime does before Create.
func prepared(ctx context.Context, t *testing.T, d *proxmox.Driver, s agent.Spec) agent.Spec {
	t.Helper()
	id, err := d.Prepare(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	s.ProviderID = id
	return s
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// waitRunning polls Get until the instance runs with an address.
func waitRunning(t *testing.T, ctx context.Context, d *proxmox.Driver, ref agent.Ref) agent.Instance {
	t.Helper()
	var (
		inst agent.Instance
		err  error
	)
	if testwait.For(ctx, func() bool {
		inst, err = d.Get(ctx, ref)
		if err != nil && agent.Classify(err) != agent.ClassTransient {
			t.Fatalf("Get %s: %v", ref.ProxyID, err)
		}
		return err == nil && inst.State == agent.StateRunning && inst.Address != ""
	}) != nil {
		t.Fatalf("%s never reached running: last %+v %v", ref.ProxyID, inst, err)
	}
	return inst
}

// waitEvent waits, within ctx's deadline, for proxy's event of kind.
func (e *env) waitEvent(ctx context.Context, store *bus.EventStore, proxy, kind string) bus.Event {
	e.t.Helper()
	deadline, _ := ctx.Deadline()
	return bustest.WaitEvent(e.t, time.Until(deadline), store, proxy, kind)
}

// reservations returns every live key of the fleet-vmids bucket.
func (e *env) reservations() []string {
	e.t.Helper()
	lister, err := e.kv.ListKeys(context.Background())
	if err != nil {
		e.t.Fatal(err)
	}
	var keys []string
	for k := range lister.Keys() {
		keys = append(keys, k)
	}
	return keys
}

// vmsOf returns the fake's VMs whose description names proxy.
func (e *env) vmsOf(proxy string) []pvetest.VMInfo {
	var out []pvetest.VMInfo
	for _, v := range e.fake.VMs() {
		if containsLine(v.Conf["description"], "proxyfleet.proxy: "+proxy) {
			out = append(out, v)
		}
	}
	return out
}

// wantOneVM fails the test unless proxy has exactly one VM.
func (e *env) wantOneVM(proxy string) {
	e.t.Helper()
	if got := e.vmsOf(proxy); len(got) != 1 {
		e.t.Errorf("proxy %s has %d VMs, want 1: %v", proxy, len(got), e.fake.VMs())
	}
}

func containsLine(s, line string) bool {
	for _, l := range splitLines(s) {
		if l == line {
			return true
		}
	}
	return false
}

func splitLines(s string) []string {
	var out []string
	start := 0
	for i := 0; i < len(s); i++ {
		if s[i] == '\n' {
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return append(out, s[start:])
}
