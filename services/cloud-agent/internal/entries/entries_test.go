package entries_test

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/services/cloud-agent/internal/config"
	"proxyfleet/services/cloud-agent/internal/entries"
)

// kubeconfig writes a kubeconfig naming a server that never answers: the
// runtimes are built and run without calling it.
func kubeconfig(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	doc := `apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
`
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// serviceAccount writes a service-account key file with a fresh key.
func serviceAccount(t *testing.T) string {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(map[string]string{
		"type": "service_account", "project_id": "proj-1", "private_key_id": "k1",
		"private_key":  string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})),
		"client_email": "agent@proj-1.iam.gserviceaccount.com", "client_id": "1", "token_uri": "https://127.0.0.1:1/token",
	})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "sa.json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func parse(t *testing.T, doc string) *config.File {
	t.Helper()
	f, err := config.Parse([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestRuntimesOnePerEntryAndTarget(t *testing.T) {
	conn := bustest.Start(t)
	f := parse(t, fmt.Sprintf(`
entries:
  - name: gce-eu
    type: gce
    targets: [europe-west1-b, europe-west1-c]
    gce:
      project: proj-1
      credentialsFile: %s
      endpoint: https://127.0.0.1:1/compute/v1/
      images: {debian-12: projects/debian-cloud/global/images/family/debian-12}
      profiles: {small: e2-small}
  - name: k8s
    type: kubernetes
    targets: [proxies]
    kubernetes: {kubeconfig: %s}
`, serviceAccount(t), kubeconfig(t)))
	runners, err := entries.Runtimes(context.Background(), conn, entries.Options{File: f})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range runners {
		got = append(got, r.String())
	}
	want := []string{"agent gce-eu.europe-west1-b", "agent gce-eu.europe-west1-c", "agent k8s.proxies"}
	if !slices.Equal(got, want) {
		t.Errorf("runtimes = %q, want %q", got, want)
	}
}

func TestRuntimesNameTheEntryWhoseClientFails(t *testing.T) {
	conn := bustest.Start(t)
	f := parse(t, `
entries:
  - name: k8s
    type: kubernetes
    targets: [proxies]
    kubernetes: {kubeconfig: /nonexistent/kubeconfig}
`)
	runners, err := entries.Runtimes(context.Background(), conn, entries.Options{File: f})
	if err == nil || !strings.HasPrefix(err.Error(), "entry k8s: kubernetes client: ") || runners != nil {
		t.Fatalf("Runtimes = %v, %v; want no runtimes and an error naming entry k8s", runners, err)
	}
}

// TestRunServesEveryTarget runs the runtimes of a kubernetes entry with two
// targets on a real NATS server: both heartbeat with the entry's
// capabilities, and the end of the context stops both, Run returning nil.
func TestRunServesEveryTarget(t *testing.T) {
	conn := bustest.Start(t)
	f := parse(t, fmt.Sprintf(`
entries:
  - name: k8s
    type: kubernetes
    targets: [proxies, more]
    capacity: 5
    kubernetes:
      kubeconfig: %s
      images: {squid: ubuntu/squid:6.10}
`, kubeconfig(t)))
	running, stop := agenttest.Serve(t, func(ctx context.Context) error {
		return entries.Run(ctx, conn, entries.Options{File: f})
	})
	for _, target := range []string{"proxies", "more"} {
		hb := agenttest.WaitHeartbeat(running, t, conn, "k8s", target)
		if hb.Type != "kubernetes" || hb.Target != target || hb.Capacity != 5 || !slices.Equal(hb.Images, []string{"squid"}) {
			t.Errorf("heartbeat of %s = %+v", target, hb)
		}
	}
	if err := stop(); err != nil {
		t.Fatalf("Run = %v after its context ended, want nil", err)
	}
}
