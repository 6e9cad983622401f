package local

import (
	"maps"
	"os/exec"
	"strings"
	"testing"

	"proxyfleet/pkg/agent/agenttest"
)

// TestLabelsFlagAnnouncedInHeartbeat runs the built agent with --labels
// and expects exactly those labels in its fleet-agents heartbeat.
func TestLabelsFlagAnnouncedInHeartbeat(t *testing.T) {
	e := newAgentEnv(t)
	t.Cleanup(func() {
		if t.Failed() {
			dumpLogs(t, e.dataDir)
		}
	})
	e.startAgentProcess(t, "agent.log", "--labels", "region=eu-west, country=de,provider=hetzner_1")
	hb := agenttest.WaitHeartbeat(ctxT(t), t, e.conn, "local", testTarget)
	want := map[string]string{"region": "eu-west", "country": "de", "provider": "hetzner_1"}
	if !maps.Equal(hb.Labels, want) {
		t.Errorf("heartbeat labels = %v, want %v", hb.Labels, want)
	}
}

// TestLabelsFlagRefusesBadLabels expects a bad --labels to stop the agent
// before it connects, exit 2, with a message naming the flag and the
// offending label.
func TestLabelsFlagRefusesBadLabels(t *testing.T) {
	cases := map[string]string{
		"Region=eu":           `"Region"`,
		"region=EU":           `"EU"`,
		"region":              "key=value",
		"region=eu,region=us": "twice",
		"region=":             "region",
		"a=1,b=1,c=1,d=1,e=1,f=1,g=1,h=1,i=1,j=1,k=1,l=1,m=1,n=1,o=1,p=1,q=1": "at most 16",
		"k=" + strings.Repeat("v", 64):                                        "1-63",
	}
	for arg, want := range cases {
		out, err := exec.Command(agentBin, "--nats-url", "nats://127.0.0.1:1", "--data-dir", t.TempDir(), "--labels", arg).CombinedOutput()
		ee, ok := err.(*exec.ExitError)
		if !ok || ee.ExitCode() != 2 {
			t.Errorf("--labels %q: err %v, want exit 2; output:\n%s", arg, err, out)
			continue
		}
		if !strings.Contains(string(out), "-labels") || !strings.Contains(string(out), want) {
			t.Errorf("--labels %q: output does not name the flag and %s:\n%s", arg, want, out)
		}
	}
}
