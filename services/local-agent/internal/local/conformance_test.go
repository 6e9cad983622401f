package local

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
)

func TestDriverConformance(t *testing.T) {
	agenttest.RunDriverConformance(t, agenttest.Harness{
		New: func(t *testing.T) agenttest.Backend {
			d := newDriver(t, Config{})
			return agenttest.Backend{
				Driver: d,
				Spec:   spec,
				Foreign: func(t *testing.T, name string) func() bool {
					files := foreignFiles(name)
					writeFiles(t, d.cfg.StateDir, files)
					return func() bool {
						for f, content := range files {
							if b, err := os.ReadFile(filepath.Join(d.cfg.StateDir, f)); err != nil || string(b) != content {
								return false
							}
						}
						return true
					}
				},
				Stop: func(t *testing.T, ref agent.Ref) string {
					pid := readState(t, d, ref.Name).PID
					killProxy(t, pid)
					return fmt.Sprintf("proxy process %d is gone", pid)
				},
			}
		},
		MissingDelete: nil, // an instance without state is already gone
	})
}

// killProxy kills the proxy process pid, as a crash or the OOM killer
// would, and waits until it is gone.
func killProxy(t *testing.T, pid int) {
	t.Helper()
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	eventually(t, "killed proxy to exit", func() bool { return processGone(pid) })
}
