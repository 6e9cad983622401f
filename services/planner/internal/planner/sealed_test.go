package planner

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
)

// agentWithoutKey announces a target whose agent has no curve key (one
// older than sealed commands).
func (h *harness) agentWithoutKey(info agent.Info) {
	h.t.Helper()
	if info.Type == "" {
		info.Type = "local"
	}
	h.mu.Lock()
	h.hbs[agent.HeartbeatKey(info.Entry, info.Target)] = info
	delete(h.keys, agent.HeartbeatKey(info.Entry, info.Target))
	err := h.putHeartbeat(context.Background(), info)
	h.mu.Unlock()
	if err != nil {
		h.t.Fatal(err)
	}
}

// TestCreateWaitsForTheAgentsKey: a pool with a password on a target
// whose agent announced no curve key sends no create (there is nothing to
// seal the password to), and pool.get says why; a pool without secrets is
// placed there as before. Once the agent announces a key, the creates go
// out sealed to it, with no plaintext secret in the stored command.
func TestCreateWaitsForTheAgentsKey(t *testing.T) {
	const password = "Wait-For-Key-Pw-93"
	h := newHarness(t)
	h.agentWithoutKey(agent.Info{Entry: "local", Target: "t1"})
	r := h.startPlannerWith(Config{ID: "keys", ReconcileInterval: 200 * time.Millisecond}, nil)
	h.waitFor("leader", r.IsLeader)

	h.ok(poolApply, `{"name":"plain","provider":"local","size":1}`, nil)
	h.ok(poolApply, `{"name":"sec","provider":"local","size":2,"auth":{"username":"crawler","password":"`+password+`"}}`, nil)
	c := h.waitCondition("sec", events.ConditionPlaced, events.ConditionFalse, events.ReasonSecretsUnavailable, 5*time.Second)
	if !strings.Contains(c.Message, "local/t1") || !strings.Contains(c.Message, "curve key") {
		t.Errorf("condition message %q does not name the target and the missing key", c.Message)
	}
	h.waitFor("the plain pool's create", func() bool { return len(h.commandsOf(events.VerbCreate)) == 1 })
	h.settle(r, 3)
	for _, c := range h.commandsOf(events.VerbCreate) {
		if c.Create.Pool != "plain" || c.Create.Sealed != nil {
			t.Fatalf("create %+v sent while the agent has no key; want only the plain pool's, unsealed", c.Create)
		}
	}
	for _, e := range h.eventsOf(events.AggregateProxy, events.ProxyRequested) {
		var d events.ProxyRequestedData
		if err := e.DecodeData(&d); err == nil && d.Pool == "sec" {
			t.Fatalf("proxy %s of the secret pool decided with no key to seal to", e.ID)
		}
	}

	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.waitFor("the secret pool's creates", func() bool { return len(h.commandsOf(events.VerbCreate)) == 3 })
	for _, c := range h.commandsOf(events.VerbCreate) {
		if c.Create.Pool != "sec" {
			continue
		}
		if c.Create.Sealed == nil || c.Secrets.Password != password || c.Create.Auth == nil || c.Create.Auth.Password != "" {
			t.Errorf("create %s: sealed %v, opened password ok %v, plaintext auth %+v", c.Create.ProxyID, c.Create.Sealed != nil, c.Secrets.Password == password, c.Create.Auth)
		}
		if strings.Contains(string(c.Raw), password) {
			t.Errorf("create %s carries the password in plaintext", c.Create.ProxyID)
		}
	}
	h.waitCondition("sec", events.ConditionPlaced, events.ConditionTrue, events.ReasonPlaced, 5*time.Second)
}

// probeCred reads and opens pool's probe credential with kp.
func (h *harness) probeCred(kv jetstream.KeyValue, kp nkeys.KeyPair, pool string) (events.ProbeSecret, error) {
	var s events.ProbeSecret
	e, err := kv.Get(context.Background(), pool)
	if err != nil {
		return s, err
	}
	var c events.ProbeCredential
	if err := json.Unmarshal(e.Value(), &c); err != nil {
		return s, err
	}
	plain, err := seal.Open(kp, &c.Sealed)
	if err != nil {
		return s, err
	}
	err = json.Unmarshal(plain, &s)
	return s, err
}

// TestCredentialsSealedToReaders: the planner writes each pool's
// password into fleet-probe-creds sealed to the key health announced, and
// into fleet-gateway-creds sealed to the gateway's, in nothing readable
// without that key; a new password or a new key is sealed again;
// pool.delete removes the credential, leftovers too.
func TestCredentialsSealedToReaders(t *testing.T) {
	for _, bucket := range []string{bus.BucketProbeCreds, bus.BucketGatewayCreds} {
		t.Run(bucket, func(t *testing.T) { testCredentialsSealed(t, bucket) })
	}
}

func testCredentialsSealed(t *testing.T, bucket string) {
	ctx := context.Background()
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	kv, err := h.c.JS.KeyValue(ctx, bucket)
	if err != nil {
		t.Fatal(err)
	}
	health, _ := seal.NewKey()
	if _, err := kv.Put(ctx, events.ProbeRecipientKey, []byte(seal.Public(health))); err != nil {
		t.Fatal(err)
	}
	h.leader()
	h.ok(poolApply, `{"name":"sec","provider":"local","size":0,"auth":{"username":"crawler","password":"Probe-Pw-1"}}`, nil)
	h.ok(poolApply, `{"name":"open","provider":"local","size":0}`, nil)
	want := func(kp nkeys.KeyPair, pw string) {
		t.Helper()
		h.waitFor("probe credential "+pw, func() bool {
			s, err := h.probeCred(kv, kp, "sec")
			return err == nil && s.Pool == "sec" && s.Password == pw
		})
		e, _ := kv.Get(ctx, "sec")
		if strings.Contains(string(e.Value()), pw) {
			t.Fatalf("%s holds the password in plaintext: %s", bucket, e.Value())
		}
	}
	want(health, "Probe-Pw-1")
	if _, err := kv.Get(ctx, "open"); err == nil {
		t.Error("a pool without password got a probe credential")
	}

	h.ok(poolApply, `{"name":"sec","provider":"local","size":0,"auth":{"username":"crawler","password":"Probe-Pw-2"}}`, nil)
	want(health, "Probe-Pw-2")

	// A new health key (a replica with another key file) is sealed to
	// as soon as it is announced.
	health2, _ := seal.NewKey()
	if _, err := kv.Put(ctx, events.ProbeRecipientKey, []byte(seal.Public(health2))); err != nil {
		t.Fatal(err)
	}
	want(health2, "Probe-Pw-2")

	h.ok(poolDelete, `{"name":"sec"}`, nil)
	if _, err := kv.Get(ctx, "sec"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("probe credential after pool.delete: %v, want %v", err, jetstream.ErrKeyNotFound)
	}
	// A leftover (a crash between the removals) goes with the next
	// pool.delete.
	raw, _ := json.Marshal(events.ProbeCredential{Revision: 2, Sealed: events.Sealed{To: seal.Public(health2), From: seal.Public(health), Box: []byte{1}}})
	if _, err := kv.Put(ctx, "sec", raw); err != nil {
		t.Fatal(err)
	}
	h.ok(poolDelete, `{"name":"sec"}`, nil)
	if _, err := kv.Get(ctx, "sec"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("leftover probe credential after a repeated pool.delete: %v, want %v", err, jetstream.ErrKeyNotFound)
	}
}

// TestDigestKeyIsCreatedOnce: planners starting at once end with one
// digest key, the one stored in fleet-secrets, and a later start reads it.
func TestDigestKeyIsCreatedOnce(t *testing.T) {
	h := newHarness(t)
	keys := make([][]byte, 6)
	var wg sync.WaitGroup
	for i := range keys {
		wg.Go(func() {
			k, err := loadDigestKey(context.Background(), h.secret)
			if err != nil {
				t.Error(err)
			}
			keys[i] = k
		})
	}
	wg.Wait()
	e, err := h.secret.Get(context.Background(), DigestKeyName)
	if err != nil {
		t.Fatal(err)
	}
	if len(e.Value()) != events.DigestKeyLen || e.Revision() != 1 {
		t.Fatalf("stored key: %d bytes at revision %d, want %d bytes written once", len(e.Value()), e.Revision(), events.DigestKeyLen)
	}
	for i, k := range keys {
		if !bytes.Equal(k, e.Value()) {
			t.Fatalf("planner %d got another key than the stored one", i)
		}
	}
	if _, err := h.secret.Put(context.Background(), DigestKeyName, []byte("short")); err != nil {
		t.Fatal(err)
	}
	if _, err := loadDigestKey(context.Background(), h.secret); err == nil || !strings.Contains(err.Error(), "delete it") {
		t.Fatalf("a damaged key: err = %v, want a refusal saying what to do", err)
	}
}
