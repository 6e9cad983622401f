package agent_test

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nkeys"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
)

// specDriver records the specs its Create was given.
type specDriver struct {
	*memDriver
	smu   sync.Mutex
	specs map[string]agent.Spec
}

func (d *specDriver) Create(ctx context.Context, s agent.Spec) (agent.Instance, error) {
	d.smu.Lock()
	d.specs[s.ProxyID] = s
	d.smu.Unlock()
	return d.memDriver.Create(ctx, s)
}

func (d *specDriver) spec(id string) (agent.Spec, bool) {
	d.smu.Lock()
	defer d.smu.Unlock()
	s, ok := d.specs[id]
	return s, ok
}

// runKeyed starts a runtime whose key lives in keyDir; stop ends it.
func (h *harness) runKeyed(drv agent.Driver, keyDir string) (stop func()) {
	h.t.Helper()
	rt, err := agent.New(bustest.Dial(h.t, h.conn), drv, agent.Config{
		Info:          agent.Info{Entry: "mem", Target: "t1", Type: "memory"},
		WatchInterval: 10 * time.Millisecond, HeartbeatInterval: 100 * time.Millisecond,
		RecheckInterval: -1, KeyDir: keyDir,
	}, nil, nil)
	if err != nil {
		h.t.Fatal(err)
	}
	_, stopped := agenttest.Serve(h.t, rt.Run)
	return func() { _ = stopped() }
}

const (
	sealedPassword = "Sealed-Pass-4711"
	sealedUserData = "#cloud-config\nruncmd: [echo SEALED-USERDATA]\n"
)

// sealedCreate publishes a create whose secrets are sealed to xkey, as
// the planner sends it.
func (h *harness) sealedCreate(id, xkey string, sec events.CommandSecrets) {
	h.t.Helper()
	plain, _ := json.Marshal(sec)
	box, err := seal.Seal(plain, xkey)
	if err != nil {
		h.t.Fatal(err)
	}
	cmd := events.CreateCommand{
		ProxyID:   id,
		ProxySpec: events.ProxySpec{Pool: "p", Entry: "mem", Target: "t1", Instance: events.InstanceName(id), Port: 3128},
		Attempt:   1,
		Auth:      &events.ProxyAuth{Username: "crawler"},
		Sealed:    box,
	}
	if _, err := bus.PublishCreate(context.Background(), h.conn, "test", cmd, 0); err != nil {
		h.t.Fatal(err)
	}
}

func newHarnessOnly(t *testing.T) *harness {
	c := bustest.Start(t)
	return &harness{t: t, conn: c, store: bus.NewEventStore(c, "test", nil)}
}

// TestSealedSecretsReachTheDriver: the agent announces its curve key,
// keeps it in a 0600 file, and opens a create's sealed secrets into the
// spec its driver gets.
func TestSealedSecretsReachTheDriver(t *testing.T) {
	h := newHarnessOnly(t)
	d := &specDriver{memDriver: newMemDriver(), specs: map[string]agent.Spec{}}
	dir := t.TempDir()
	h.runKeyed(d, dir)
	hb := agenttest.WaitHeartbeat(context.Background(), t, h.conn, "mem", "t1")
	if err := seal.CheckPublic(hb.XKey); err != nil {
		t.Fatalf("heartbeat key: %v", err)
	}
	fi, err := os.Stat(agent.KeyFile(dir, "mem", "t1"))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file: %v, mode %v; want 0600", err, fi)
	}
	kp, err := seal.Load(agent.KeyFile(dir, "mem", "t1"))
	if err != nil || seal.Public(kp) != hb.XKey {
		t.Fatalf("key file holds %v (%v), heartbeat announces %s", kp, err, hb.XKey)
	}
	h.sealedCreate("s-1", hb.XKey, events.CommandSecrets{ProxyID: "s-1", Password: sealedPassword, UserData: []byte(sealedUserData)})
	h.waitFor("s-1", events.ProxyRunning)
	s, ok := d.spec("s-1")
	if !ok || s.Auth == nil || s.Auth.Username != "crawler" || s.Auth.Password != sealedPassword || string(s.UserData) != sealedUserData {
		t.Fatalf("driver spec: auth %+v user-data %q, want crawler with the sealed password and user-data", s.Auth, s.UserData)
	}
}

// TestUnopenableSecretsFailPermanently: a create sealed to another key,
// or whose box belongs to another proxy, fails at once with a permanent
// failure naming the cause, never reaches the driver, and neither the
// failure nor anything else quotes the secrets.
func TestUnopenableSecretsFailPermanently(t *testing.T) {
	h := newHarnessOnly(t)
	d := &specDriver{memDriver: newMemDriver(), specs: map[string]agent.Spec{}}
	h.runKeyed(d, t.TempDir())
	hb := agenttest.WaitHeartbeat(context.Background(), t, h.conn, "mem", "t1")
	other, _ := nkeys.CreateCurveKeys()

	h.sealedCreate("w-1", seal.Public(other), events.CommandSecrets{ProxyID: "w-1", Password: sealedPassword})
	h.sealedCreate("w-2", hb.XKey, events.CommandSecrets{ProxyID: "someone-else", Password: sealedPassword})
	for id, want := range map[string]string{"w-1": "sealed to another key", "w-2": "sealed for proxy"} {
		evs := h.waitFor(id, events.ProxyFailed)
		var f events.ProxyFailedData
		if err := evs[len(evs)-1].DecodeData(&f); err != nil {
			t.Fatal(err)
		}
		if f.Class != events.ClassPermanent || !strings.Contains(f.Reason, want) {
			t.Errorf("%s failed: class %s reason %q, want permanent naming %q", id, f.Class, f.Reason, want)
		}
		if strings.Contains(string(evs[len(evs)-1].Data), sealedPassword) {
			t.Errorf("%s: the failure quotes the password", id)
		}
		if _, ok := d.spec(id); ok {
			t.Errorf("%s reached the driver", id)
		}
	}
	h.waitQueueEmpty()
}

// TestRestartedAgentKeepsItsKey: a create sealed while the agent was
// down opens after the restart, because the key is read back from its
// file.
func TestRestartedAgentKeepsItsKey(t *testing.T) {
	h := newHarnessOnly(t)
	dir := t.TempDir()
	d := &specDriver{memDriver: newMemDriver(), specs: map[string]agent.Spec{}}
	stop := h.runKeyed(d, dir)
	first := agenttest.WaitHeartbeat(context.Background(), t, h.conn, "mem", "t1").XKey
	stop()

	h.sealedCreate("r-1", first, events.CommandSecrets{ProxyID: "r-1", Password: sealedPassword})
	h.runKeyed(d, dir)
	if again := agenttest.WaitHeartbeat(context.Background(), t, h.conn, "mem", "t1").XKey; again != first {
		t.Fatalf("restarted agent announces %s, want its old key %s", again, first)
	}
	h.waitFor("r-1", events.ProxyRunning)
	if s, _ := d.spec("r-1"); s.Auth == nil || s.Auth.Password != sealedPassword {
		t.Fatalf("after the restart the driver got auth %+v, want the sealed password", s.Auth)
	}
}

// TestAgentKeyMustBeACurveKeyOfItsOwner: a key of another kind, or a key
// file others may read, stops the runtime from starting, saying why.
func TestAgentKeyMustBeACurveKeyOfItsOwner(t *testing.T) {
	c := bustest.Start(t)
	info := agent.Info{Entry: "mem", Target: "t1", Type: "memory"}
	user, _ := nkeys.CreateUser()
	if _, err := agent.New(c, newMemDriver(), agent.Config{Info: info, Key: user}, nil, nil); err == nil || !strings.Contains(err.Error(), "curve") {
		t.Errorf("a user nkey as the agent key: err = %v, want a refusal naming curve keys", err)
	}
	dir := t.TempDir()
	kp, _ := seal.NewKey()
	seed, _ := kp.Seed()
	if err := os.WriteFile(agent.KeyFile(dir, "mem", "t1"), seed, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := agent.New(c, newMemDriver(), agent.Config{Info: info, KeyDir: dir}, nil, nil); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Errorf("a key file readable by others: err = %v, want a refusal saying chmod 600", err)
	}
}
