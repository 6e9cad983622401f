package planner

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
)

func TestSecretsNeverEnterEvents(t *testing.T) {
	const password, userData = "pa55-Sekr1t-xyz", "#cloud-config\nruncmd: [echo USERDATA-MARKER-42]\n"
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	h.leader()
	spec := events.PoolSpec{Name: "sec", Provider: "local", Size: 2, Auth: &events.ProxyAuth{Username: "crawler", Password: password}, UserData: userData}
	body, _ := json.Marshal(spec)
	h.ok(poolApply, string(body), nil)
	ids, _ := h.requested(2)
	h.waitFor("create commands", func() bool { return len(h.commandsOf(events.VerbCreate)) == 2 })
	h.ok(proxyRecycle, `{"id":"`+ids[0]+`"}`, nil)
	h.requested(3)

	for _, e := range h.events() {
		raw, _ := json.Marshal(e.Envelope)
		hdr, _ := json.Marshal(e.Header)
		for _, s := range []string{password, "USERDATA-MARKER-42"} {
			if strings.Contains(string(raw), s) || strings.Contains(string(hdr), s) {
				t.Errorf("event %d (%s %s) contains a secret", e.Seq, e.ID, e.Kind)
			}
		}
	}
	applied := h.eventsOf(events.AggregatePool, events.PoolApplied)
	var ad events.PoolAppliedData
	if err := applied[0].DecodeData(&ad); err != nil {
		t.Fatal(err)
	}
	dk, err := h.secret.Get(context.Background(), DigestKeyName)
	if err != nil {
		t.Fatalf("digest key: %v", err)
	}
	if ad.SecretsDigest != spec.Secrets().Digest(dk.Value()) || ad.Spec.Auth == nil || ad.Spec.Auth.Username != "crawler" {
		t.Errorf("applied: got %+v, want the keyed digest and username only", ad)
	}
	e, err := h.secret.Get(context.Background(), "sec")
	if err != nil {
		t.Fatal(err)
	}
	var stored events.PoolSecrets
	_ = json.Unmarshal(e.Value(), &stored)
	if stored.Password != password || stored.UserData != userData || stored.Revision != 1 {
		t.Errorf("fleet-secrets: got revision %d, want the secrets of revision 1", stored.Revision)
	}
	for _, c := range h.commandsOf(events.VerbCreate) {
		if c.Create.Auth == nil || c.Create.Auth.Username != "crawler" || c.Secrets.Password != password || string(c.Secrets.UserData) != userData {
			t.Errorf("create command for %s lacks the secrets the agent needs", c.Create.ProxyID)
		}
		if strings.Contains(string(c.Raw), password) || strings.Contains(string(c.Raw), "USERDATA-MARKER-42") ||
			strings.Contains(string(c.Raw), base64.StdEncoding.EncodeToString([]byte(userData))) {
			t.Errorf("create command for %s carries a secret in plaintext: %s", c.Create.ProxyID, c.Raw)
		}
	}
	// A changed password is a new revision, still out of the log.
	spec.Auth.Password = "another-Secret-77"
	body, _ = json.Marshal(spec)
	var pv api.PoolView
	h.ok(poolApply, string(body), &pv)
	if pv.Revision != 2 {
		t.Errorf("password change: revision %d, want 2", pv.Revision)
	}
	for _, e := range h.events() {
		if strings.Contains(string(e.Data), "another-Secret-77") {
			t.Errorf("event %d contains the new password", e.Seq)
		}
	}
}

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

// TestPoolDeleteRemovesSecrets: pool.delete removes the pool's secrets
// from fleet-secrets; a repeated pool.delete (after a crash between the
// event and the removal) removes leftovers without appending; a late
// removal never takes the secrets of a later apply; re-applying the pool
// writes fresh secrets its proxies are created with.
func TestPoolDeleteRemovesSecrets(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	r := h.leader()
	ctx := context.Background()
	const spec = `{"name":"demo","provider":"local","size":1,"userData":"#cloud-config\n","auth":{"username":"u","password":"pw-1"}}`
	h.ok(poolApply, spec, nil)
	h.requested(1)
	if _, err := h.secret.Get(ctx, "demo"); err != nil {
		t.Fatalf("secrets after apply: %v", err)
	}

	var pv api.PoolView
	h.ok(poolDelete, `{"name":"demo"}`, &pv)
	if !pv.Deleted || pv.Revision != 2 {
		t.Fatalf("delete reply: got %+v, want deleted at revision 2", pv)
	}
	if _, err := h.secret.Get(ctx, "demo"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("secrets after pool.delete: got %v, want %v", err, jetstream.ErrKeyNotFound)
	}
	if n := len(h.eventsOf(events.AggregatePool, events.PoolDeleted)); n != 1 {
		t.Fatalf("pool deleted events: got %d, want 1", n)
	}

	// The reconciler retires the deleted pool's proxy on its own; let it
	// finish before counting what the repeated delete appends.
	h.waitFor("the deleted pool's proxy retired", func() bool {
		return len(h.eventsOf(events.AggregateProxy, events.ProxyRetiring)) == 1
	})
	h.settle(r, 3)

	// As if the planner crashed after the deleted event: the secrets of
	// revision 1 are still there. A repeated delete removes them.
	putSecrets(t, h, "demo", events.PoolSecrets{Revision: 1, Password: "pw-1"})
	h.appendsNothing("the repeated delete", func() { h.ok(poolDelete, `{"name":"demo"}`, nil) })
	if _, err := h.secret.Get(ctx, "demo"); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("leftover secrets after the repeated pool.delete: got %v, want %v", err, jetstream.ErrKeyNotFound)
	}

	// Re-applying brings the pool back with fresh secrets, which reach the
	// new proxy's create command.
	h.ok(poolApply, strings.Replace(spec, "pw-1", "pw-2", 1), &pv)
	if pv.Deleted || pv.Revision != 3 {
		t.Fatalf("re-apply: got %+v, want revision 3, not deleted", pv)
	}
	ids, _ := h.requested(2)
	h.waitFor("create of the re-applied pool", func() bool {
		for _, c := range h.commandsOf(events.VerbCreate) {
			if c.Create.ProxyID == ids[1] {
				return true
			}
		}
		return false
	})
	for _, c := range h.commandsOf(events.VerbCreate) {
		if c.Create.ProxyID == ids[1] && (c.Create.Auth == nil || c.Secrets.Password != "pw-2" || string(c.Secrets.UserData) != "#cloud-config\n") {
			t.Errorf("create of the re-applied pool: auth %+v user-data %q, want password pw-2 and the user-data", c.Create.Auth, c.Secrets.UserData)
		}
	}
	// A removal for the deletion at revision 2 that runs only now (a
	// pool.delete racing the re-apply) leaves revision 3's secrets alone.
	if aerr := (backend{r.Planner}).removeSecrets(ctx, "demo", 2); aerr != nil {
		t.Fatal(aerr)
	}
	e, err := h.secret.Get(ctx, "demo")
	if err != nil {
		t.Fatalf("secrets of revision 3 after a late removal of revision 2: %v", err)
	}
	var have events.PoolSecrets
	if err := json.Unmarshal(e.Value(), &have); err != nil || have.Revision != 3 || have.Password != "pw-2" {
		t.Errorf("secrets: got %+v (%v), want revision 3 with pw-2", have, err)
	}
}

func putSecrets(t *testing.T, h *harness, pool string, s events.PoolSecrets) {
	t.Helper()
	b, _ := json.Marshal(s)
	if _, err := h.secret.Put(context.Background(), pool, b); err != nil {
		t.Fatal(err)
	}
}

// TestDeletedPoolNeedsNoSecrets: a planner that takes the lead over a
// deleted pool (its secrets removed) with a proxy still requested retires
// the proxy without re-sending its create and without complaining about
// the missing secrets; a pool without secrets the same.
func TestDeletedPoolNeedsNoSecrets(t *testing.T) {
	h := newHarness(t)
	h.agent(agent.Info{Entry: "local", Target: "t1"})
	ctx := context.Background()
	withSecrets := events.PoolSecrets{Password: "pw"}
	ids := map[string]string{}
	for pool, digest := range map[string]string{"secret": withSecrets.Digest([]byte("k")), "plain": ""} {
		spec := events.PoolSpec{Name: pool, Provider: "local", Size: 1, Port: events.DefaultProxyPort}
		if digest != "" {
			spec.Auth = &events.ProxyAuth{Username: "u"}
		}
		applied := events.PoolAppliedData{Spec: spec, Revision: 1, SecretsDigest: digest}
		if _, err := h.store.Append(ctx, events.AggregatePool, pool, events.PoolApplied, pool+".applied.1", applied, &bus.Expect{Seq: 0}); err != nil {
			t.Fatal(err)
		}
		id := events.NewProxyID(pool)
		ids[id] = pool
		req := events.ProxyRequestedData{ProxySpec: events.ProxySpec{Pool: pool, Entry: "local", Target: "t1", Instance: events.InstanceName(id), Revision: 1, Port: spec.Port}}
		if _, err := h.store.Append(ctx, events.AggregateProxy, id, events.ProxyRequested, events.ProxyEventID(id, events.ProxyRequested, 1), req, &bus.Expect{Seq: 0}); err != nil {
			t.Fatal(err)
		}
		if _, err := h.store.Append(ctx, events.AggregatePool, pool, events.PoolDeleted, pool+".deleted.2", events.PoolDeletedData{Revision: 2}, nil); err != nil {
			t.Fatal(err)
		}
	}
	rec := &logRecorder{}
	r := h.startPlannerWith(Config{ID: "p1"}, nil, func(p *Planner) { p.log = slog.New(rec) })
	h.waitFor("leader", r.IsLeader)
	h.waitFor("both proxies retired", func() bool { return len(h.commandsOf(events.VerbDelete)) == 2 })
	h.settle(r, 3)
	for _, c := range h.commandsOf(events.VerbDelete) {
		if _, ok := ids[c.Delete.ProxyID]; !ok || c.Delete.Reason != "pool deleted" {
			t.Errorf("delete: got %+v, want one of %v with reason %q", c.Delete, ids, "pool deleted")
		}
	}
	if creates := h.commandsOf(events.VerbCreate); len(creates) != 0 {
		t.Errorf("create commands for deleted pools: got %d (%+v), want none", len(creates), creates[0].Create)
	}
	if logs := rec.all(); len(logs) != 0 {
		t.Errorf("warnings and errors: got %q, want none", logs)
	}
}
