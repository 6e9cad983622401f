package nodes_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/buildinfo"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/services/proxmox-agent/internal/config"
	"proxyfleet/services/proxmox-agent/internal/nodes"
	"proxyfleet/services/proxmox-agent/internal/pve"
	"proxyfleet/services/proxmox-agent/internal/pve/pvetest"
)

// parse returns the config of an agent of fake serving nodes, with the
// API token in tokenFile.
func parse(t *testing.T, fake *pvetest.Server, tokenFile string, nodeList string) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(`
entry: pve-home
apiURL: ` + fake.URL + `
tokenFile: ` + tokenFile + `
fingerprint: "` + pve.FormatFingerprint(fake.Fingerprint()) + `"
nodes: ` + nodeList + `
templates: {debian-13: 9000}
seedsStorage: proxy-seeds
profiles: {small: {cores: 1, memoryMiB: 512}}
capacity: 7
`))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func writeToken(t *testing.T, fake *pvetest.Server) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(path, []byte(fake.Token()), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestRunServesEveryNode runs one runtime per node against the fake
// cluster and a real NATS server: each node heartbeats with the config's
// capabilities and answers its own check; the end of the context stops
// them all and Run returns nil.
func TestRunServesEveryNode(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{Nodes: []string{"pve1", "pve2"}})
	fake.AddTemplate("pve1", 9000, "debian-13")
	conn := bustest.Start(t)
	cfg := parse(t, fake, writeToken(t, fake), "[pve1, pve2]")

	running, stop := agenttest.Serve(t, func(ctx context.Context) error {
		return nodes.Run(ctx, conn, nodes.Options{Config: cfg})
	})
	for _, n := range []string{"pve1", "pve2"} {
		hb := agenttest.WaitHeartbeat(running, t, conn, "pve-home", n)
		if hb.Type != "proxmox" || hb.Target != n || hb.Capacity != 7 || hb.Version != buildinfo.Version ||
			strings.Join(hb.Images, ",") != "debian-13" || strings.Join(hb.Profiles, ",") != "small" {
			t.Errorf("heartbeat of %s = %+v", n, hb)
		}
	}
	verdicts := agenttest.Check(running, t, conn, "pve-home", "pve2")
	online := false
	for _, v := range verdicts {
		if v.Check == "node pve2" {
			online = v.OK
		}
	}
	if !online {
		t.Errorf("check of pve2 = %+v, want node pve2 online", verdicts)
	}

	if err := stop(); err != nil {
		t.Fatalf("Run = %v after its context ended, want nil", err)
	}
	kv, err := conn.JS.KeyValue(context.Background(), bus.BucketAgents)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"pve1", "pve2"} {
		if _, err := kv.Get(context.Background(), agent.HeartbeatKey("pve-home", n)); !errors.Is(err, jetstream.ErrKeyNotFound) {
			t.Errorf("heartbeat of %s after Run returned: err = %v, want it deleted", n, err)
		}
	}
}

func TestRuntimesRefusesAnUnusableClient(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{})
	conn := bustest.Start(t)
	cfg := parse(t, fake, filepath.Join(t.TempDir(), "no-such-token"), "[pve1]")
	runners, err := nodes.Runtimes(context.Background(), conn, nodes.Options{Config: cfg})
	if err == nil || !strings.Contains(err.Error(), "API client") || runners != nil {
		t.Fatalf("Runtimes = %v, %v; want no runtimes and an API client error", runners, err)
	}
}
