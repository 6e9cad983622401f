package e2e_test

import (
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"proxyfleet/pkg/testgate"
)

// maxExposure is the highest "Overall exposure level" systemd-analyze
// security may give a shipped unit (kvm-agent's level is 1.9; 10 is fully
// exposed).
const maxExposure = 3.0

var exposureLine = regexp.MustCompile(`Overall exposure level for (\S+): ([0-9]+(?:\.[0-9]+)?)`)

// TestSystemdUnitsHardened scores every unit in deploy/systemd with
// `systemd-analyze security --offline=yes` (the unit file alone, not the
// running system) and fails for any above maxExposure. `systemd-analyze
// verify` must not report an unknown or unparsable directive either: a
// misspelled sandboxing line is silently ignored by systemd. Offline mode
// reads User= without resolving it, so the units' users need not exist on
// the machine running the test.
func TestSystemdUnitsHardened(t *testing.T) {
	analyze := testgate.NeedBinary(t, "systemd-analyze", "install Debian's systemd package (make test-systemd does)")
	units, err := filepath.Glob(filepath.Join("..", "deploy", "systemd", "*.service"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, u := range units {
		names = append(names, filepath.Base(u))
	}
	for _, want := range []string{"planner.service", "health.service", "local-agent.service", "kvm-agent.service", "gateway.service", "console.service"} {
		if !slices.Contains(names, want) {
			t.Errorf("deploy/systemd lacks %s (found %v)", want, names)
		}
	}
	for _, u := range units {
		t.Run(filepath.Base(u), func(t *testing.T) {
			abs, err := filepath.Abs(u)
			if err != nil {
				t.Fatal(err)
			}
			out, err := exec.Command(analyze, "security", "--offline=yes", "--no-pager", abs).CombinedOutput()
			if err != nil {
				t.Fatalf("systemd-analyze security: %v\n%s", err, out)
			}
			m := exposureLine.FindSubmatch(out)
			if m == nil {
				t.Fatalf("no \"Overall exposure level\" line in:\n%s", out)
			}
			score, err := strconv.ParseFloat(string(m[2]), 64)
			if err != nil {
				t.Fatal(err)
			}
			if score > maxExposure {
				var exposed []string
				for _, line := range strings.Split(string(out), "\n") {
					if strings.HasPrefix(line, "✗") {
						exposed = append(exposed, line)
					}
				}
				t.Errorf("%s: exposure %.1f, want at most %.1f; what is exposed:\n%s", filepath.Base(u), score, maxExposure, strings.Join(exposed, "\n"))
			}
			t.Logf("%s: exposure %.1f", filepath.Base(u), score)

			vout, _ := exec.Command(analyze, "verify", "--man=no", abs).CombinedOutput()
			for _, line := range strings.Split(string(vout), "\n") {
				if strings.Contains(line, "Unknown key") || strings.Contains(line, "Unknown section") ||
					strings.Contains(line, "Failed to parse") || strings.Contains(line, "Invalid") {
					t.Errorf("systemd-analyze verify: %s", line)
				}
			}
		})
	}
}
