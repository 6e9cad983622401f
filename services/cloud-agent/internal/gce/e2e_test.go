package gce

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/pkg/testwait"
)

// serviceAccountFile writes a service-account key whose token endpoint is
// the fake, and returns its path and private key id.
func serviceAccountFile(t *testing.T, f *fakeCompute) (path, keyID, keyPEM string) {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	keyPEM = string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: must(x509.MarshalPKCS8PrivateKey(key))}))
	keyID = "canarykeyid" + strings.Repeat("7", 29)
	b, _ := json.Marshal(map[string]string{
		"type": "service_account", "project_id": "proj-1", "private_key_id": keyID, "private_key": keyPEM,
		"client_email": "agent@proj-1.iam.gserviceaccount.com", "client_id": "1234567890",
		"token_uri": f.srv.URL + "/token",
	})
	path = filepath.Join(t.TempDir(), "sa.json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return path, keyID, keyPEM
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestEndToEndWithoutSecretsInLogs runs two proxies through NATS, the agent
// runtime and this driver on the fake, authenticated with a service-account
// key file, with every log line at debug level captured: both reach running
// with addresses, both are deleted, nothing is left, and no token, key or
// user-data appears in the logs.
func TestEndToEndWithoutSecretsInLogs(t *testing.T) {
	f := newFakeCompute(t, "zone-a")
	var logs testwait.Buffer
	log := telemetry.NewLogger(&logs, slog.LevelDebug, "cloud-agent")
	// The client library's own logging at its highest level, to stderr.
	t.Setenv("GOOGLE_SDK_GO_LOGGING_LEVEL", "debug")
	stderr := captureStderr(t)

	keyFile, keyID, keyPEM := serviceAccountFile(t, f)
	svc, err := NewService(context.Background(), ServiceOptions{CredentialsFile: keyFile, Endpoint: f.base()}, log)
	if err != nil {
		t.Fatal(err)
	}
	userDataCanary := "user-data-canary-" + keyID[len(keyID)-6:] + "-q8w7e6"
	passwordCanary := "password-canary-z1x2c3v4"
	drv := New(svc, Options{Entry: "gce-eu", Zone: "zone-a", Config: testConfig(), DefaultUserData: defaultUserData, Log: log})

	conn := bustest.Start(t)
	rt, err := agent.New(bustest.Dial(t, conn), drv, agent.Config{
		Info:          agent.Info{Entry: "gce-eu", Target: "zone-a", Type: "gce"},
		WatchInterval: 10 * time.Millisecond, HeartbeatInterval: 200 * time.Millisecond,
	}, log, nil)
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = rt.Run(rctx) }()
	t.Cleanup(func() { cancel(); <-done })

	store := bus.NewEventStore(conn, "test", nil)
	ids := []string{"pool-a-aaaa", "pool-a-bbbb"}
	for _, id := range ids {
		cmd := events.CreateCommand{
			ProxyID:   id,
			ProxySpec: events.ProxySpec{Pool: "pool-a", Entry: "gce-eu", Target: "zone-a", Instance: events.InstanceName(id), Port: 3128},
			Attempt:   1,
			Auth:      &events.ProxyAuth{Username: "crawler", Password: passwordCanary},
			UserData:  []byte("#cloud-config\nwrite_files:\n- content: " + userDataCanary + "\n  path: /etc/canary\n"),
		}
		if err := cmd.Validate(); err != nil {
			t.Fatal(err)
		}
		if _, err := bus.PublishCreate(context.Background(), conn, "test", cmd, 0); err != nil {
			t.Fatal(err)
		}
	}
	providerIDs := map[string]string{}
	for _, id := range ids {
		ev := bustest.WaitEvent(t, 30*time.Second, store, id, events.ProxyRunning)
		var run events.ProxyRunningData
		if err := ev.DecodeData(&run); err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(run.Address, "203.0.113.") || !strings.HasSuffix(run.Address, ":3128") {
			t.Fatalf("%s running at %q, want a NAT address with port 3128", id, run.Address)
		}
		providerIDs[id] = run.ProviderID
	}
	if f.count() != 2 {
		t.Fatalf("instances = %d, want 2", f.count())
	}
	for _, id := range ids {
		cmd := events.DeleteCommand{ProxyID: id, Pool: "pool-a", Entry: "gce-eu", Target: "zone-a",
			Instance: events.InstanceName(id), ProviderID: providerIDs[id], Attempt: 1}
		if _, err := bus.PublishDelete(context.Background(), conn, "test", cmd, 0); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range ids {
		bustest.WaitEvent(t, 30*time.Second, store, id, events.ProxyDeleted)
	}
	if n := f.count(); n != 0 {
		t.Fatalf("%d instances left after deleting the pool", n)
	}

	// The secrets were really in play: the fake got the token, the insert
	// carried the user-data.
	f.mu.Lock()
	authed := false
	for _, a := range f.authSeen {
		authed = authed || a == "Bearer "+fakeAccessToken
	}
	f.mu.Unlock()
	if !authed {
		t.Fatal("the API never saw the service account's access token")
	}
	out := logs.String() + stderr()
	if !strings.Contains(out, `"msg":"gce api call"`) || !strings.Contains(out, `"level":"DEBUG"`) {
		t.Fatalf("no debug wire log lines captured:\n%s", out)
	}
	pemBody := strings.Split(keyPEM, "\n")[1]
	for name, secret := range map[string]string{
		"access token": fakeAccessToken, "private key": pemBody, "private key id": keyID,
		"user-data": userDataCanary, "proxy password": passwordCanary, "bearer": "Bearer",
	} {
		if strings.Contains(out, secret) {
			t.Errorf("the %s appears in the logs", name)
		}
	}
}

// captureStderr redirects os.Stderr until the test ends; the returned
// function stops the capture and returns what was written.
func captureStderr(t *testing.T) func() string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	old := os.Stderr
	os.Stderr = w
	var buf testwait.Buffer
	done := make(chan struct{})
	go func() { defer close(done); _, _ = io.Copy(&buf, r) }()
	stopped := false
	stop := func() string {
		if !stopped {
			stopped = true
			os.Stderr = old
			_ = w.Close()
			<-done
		}
		return buf.String()
	}
	t.Cleanup(func() { stop() })
	return stop
}
