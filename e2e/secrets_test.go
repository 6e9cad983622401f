package e2e_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// The secrets of the pool the secrets tests apply. Each is distinctive, so
// finding it anywhere is a leak.
const (
	leakPassword = "Leak-Check-Pw-5r8Qz"
	leakUserData = "#cloud-config\nruncmd: [echo LEAK-CHECK-USERDATA-31337]\n"
)

// TestSecretsStaySecret runs a pool with a password and user-data through
// its whole life on the built-in proxy and checks that the password and
// user-data appear in no log (every service at debug level), no process's
// command line, no FLEET_CMDS message left in the store after the agent
// acknowledged it, and no event (nor the bare SHA-256 of the password);
// that the proxies take the password and health probes with it; and that
// pool.delete removes the secrets.
func TestSecretsStaySecret(t *testing.T) {
	secretsLifecycle(t, newFleet(t))
}

// TestSecretsStaySecretSquid is the same with every proxy a real Squid
// (make test-e2e-squid).
func TestSecretsStaySecretSquid(t *testing.T) {
	secretsLifecycle(t, newSquidFleet(t))
}

// leaks are the byte strings whose presence anywhere is a leak: the
// password, the user-data's marker, the user-data as JSON encodes bytes,
// and the unsalted SHA-256 (hex) of the password.
func leaks() map[string][]byte {
	sum := sha256.Sum256([]byte(leakPassword))
	return map[string][]byte{
		"password":            []byte(leakPassword),
		"user-data":           []byte("LEAK-CHECK-USERDATA-31337"),
		"user-data (base64)":  []byte(base64.StdEncoding.EncodeToString([]byte(leakUserData))),
		"sha256(password)":    []byte(hex.EncodeToString(sum[:])),
		"password in a URL":   []byte(url.UserPassword("crawler", leakPassword).String()),
		"basic-auth password": []byte(base64.StdEncoding.EncodeToString([]byte("crawler:" + leakPassword))),
	}
}

// findLeak returns which leak b holds, or "".
func findLeak(b []byte) string {
	for what, s := range leaks() {
		if bytes.Contains(b, s) {
			return what
		}
	}
	return ""
}

func secretsLifecycle(t *testing.T, f *fleet) {
	f.dumpLogsOnFailure()
	org := origin(t)
	f.allow(org) // the origin is on loopback, which the egress policy refuses
	f.startAll()
	// Every command exactly as the server stores it in FLEET_CMDS.
	cmds, err := f.conn.NC.SubscribeSync("fleet.cmd.>")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmds.Unsubscribe() }()

	f.apply(events.PoolSpec{Name: "sec", Provider: "local", Size: 2, Auth: &events.ProxyAuth{Username: "crawler", Password: leakPassword}, UserData: leakUserData})
	// Ready means health's probes passed through each proxy, which refuses
	// requests without the password: health probes with it.
	ready := f.waitPool("sec", 2, "ready", 90*time.Second)
	for _, p := range ready {
		if code, body, err := getThrough(p.Address, org.URL, url.UserPassword("crawler", leakPassword)); err != nil || code != 200 || !strings.HasPrefix(body, "hello through") {
			t.Fatalf("GET through %s with the password: %d %q %v", p.ID, code, body, err)
		}
		if code, _, err := getThrough(p.Address, org.URL, url.UserPassword("crawler", "wrong")); err != nil || code != 407 {
			t.Fatalf("GET through %s with a wrong password: %d %v, want 407", p.ID, code, err)
		}
	}

	// Every process's command line, the proxies' above all.
	// Squid forks to start its helpers: a child is briefly a second Squid
	// process until it execs, so the count is polled.
	waitFor(t, 30*time.Second, "2 proxy processes", func() bool { return len(f.proxyProcs()) == 2 })
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		if what := findLeak(cmdline); what != "" {
			t.Errorf("process %s has the %s on its command line: %q", e.Name(), what, bytes.ReplaceAll(cmdline, []byte{0}, []byte{' '}))
		}
	}

	// The creates were acknowledged (work queue: nothing left to consume).
	// What the stream stored for them, and whatever its files still hold,
	// carries the secrets sealed only.
	waitFor(t, 30*time.Second, "FLEET_CMDS to be consumed", func() bool { return f.streamMsgs(bus.CommandsStream) == 0 })
	creates := 0
	for {
		m, err := cmds.NextMsg(100 * time.Millisecond)
		if err != nil {
			break
		}
		if strings.HasSuffix(m.Subject, ".create") {
			creates++
			if !bytes.Contains(m.Data, []byte(`"sealed"`)) {
				t.Errorf("create command %s carries no sealed secrets: %s", m.Subject, m.Data)
			}
		}
		raw := append([]byte(fmt.Sprint(m.Header)), m.Data...)
		if what := findLeak(raw); what != "" {
			t.Errorf("command %s holds the %s", m.Subject, what)
		}
	}
	if creates < 2 {
		t.Fatalf("saw %d create commands, want 2 or more", creates)
	}
	if what := findLeak(f.rawStream(bus.CommandsStream)); what != "" {
		t.Errorf("FLEET_CMDS holds the %s after acknowledgement", what)
	}
	if what := findLeak(f.storeFiles(bus.CommandsStream)); what != "" {
		t.Errorf("FLEET_CMDS' store files hold the %s after acknowledgement", what)
	}
	if what := findLeak(f.rawStream(bus.EventsStream)); what != "" {
		t.Errorf("FLEET_EVENTS holds the %s", what)
	}
	if what := findLeak(f.storeFiles(bus.EventsStream)); what != "" {
		t.Errorf("FLEET_EVENTS' store holds the %s", what)
	}

	// Scale down and delete: the secrets go with the pool.
	f.apply(events.PoolSpec{Name: "sec", Provider: "local", Size: 1, Auth: &events.ProxyAuth{Username: "crawler", Password: leakPassword}, UserData: leakUserData})
	f.waitPool("sec", 1, "ready", 60*time.Second)
	f.deletePoolAndWait("sec")
	ctx := context.Background()
	for _, bucket := range []string{bus.BucketSecrets, bus.BucketProbeCreds, bus.BucketGatewayCreds} {
		kv, err := f.conn.JS.KeyValue(ctx, bucket)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := kv.Get(ctx, "sec"); !errors.Is(err, jetstream.ErrKeyNotFound) {
			t.Errorf("%s after pool.delete: %v, want %v", bucket, err, jetstream.ErrKeyNotFound)
		}
	}

	for _, name := range []string{"planner", "health", "local-agent"} {
		logs := f.log(name)
		// Every service runs with --log-level debug (startBinary).
		if !strings.Contains(logs, ready[0].ID) {
			t.Errorf("%s's log never names proxy %s: the check proves nothing", name, ready[0].ID)
		}
		if what := findLeak([]byte(logs)); what != "" {
			t.Errorf("%s's log holds the %s", name, what)
		}
	}
	if what := findLeak(f.rawStream(bus.EventsStream)); what != "" {
		t.Errorf("FLEET_EVENTS holds the %s", what)
	}
}

// streamMsgs counts the messages stored in stream now.
func (f *fleet) streamMsgs(stream string) uint64 {
	f.t.Helper()
	return f.streamState(stream).Msgs
}

// rawStream concatenates every stored message of stream, headers and data.
func (f *fleet) rawStream(stream string) []byte {
	ctx := context.Background()
	s, err := f.conn.JS.Stream(ctx, stream)
	if err != nil {
		f.t.Fatal(err)
	}
	var out bytes.Buffer
	for seq := uint64(1); seq <= f.lastSeq(stream); seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			continue
		}
		for k, vs := range m.Header {
			out.WriteString(k + ": " + strings.Join(vs, ",") + "\n")
		}
		out.Write(m.Data)
		out.WriteByte('\n')
	}
	return out.Bytes()
}

// storeFiles concatenates the files the server stores stream in.
func (f *fleet) storeFiles(stream string) []byte {
	var out bytes.Buffer
	found := false
	_ = filepath.WalkDir(f.storeDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.Contains(path, string(filepath.Separator)+stream+string(filepath.Separator)) {
			return nil
		}
		b, err := os.ReadFile(path)
		if err == nil {
			found = true
			out.Write(b)
		}
		return nil
	})
	if !found {
		f.t.Fatalf("no store file of %s under %s", stream, f.storeDir)
	}
	return out.Bytes()
}
