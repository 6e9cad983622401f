// Package squidtest runs Debian's squid for the tests of the squid tier
// (make test-squid): it finds the binary the tier names and checks a
// configuration with `squid -k parse`.
package squidtest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"proxyfleet/pkg/testgate"
)

// EnvSquid names the squid binary of the squid tier.
const EnvSquid = "PROXYFLEET_SQUID"

// Binary returns the squid binary [EnvSquid] names. Without the variable
// the test is skipped, as it is outside the squid tier; with it, the file
// must be there ([testgate.NeedFile]).
func Binary(t testing.TB) string {
	t.Helper()
	squid := os.Getenv(EnvSquid)
	if squid == "" {
		t.Skip("squid tier: set " + EnvSquid + " to a squid binary (make test-squid)")
	}
	testgate.NeedFile(t, squid, "install Debian's squid (make squid-install)")
	return squid
}

// Parse runs `squid -k parse` on the configuration file at path. It
// returns an error, with squid's output, when squid rejects the file or
// reports a FATAL or ERROR line, or an acl entry that is a subnetwork of
// another (Squid 5.7 then silently drops one of the two, possibly the
// wider one: in a deny list that lets traffic through).
func Parse(squid, path string) error {
	out, err := exec.Command(squid, "-k", "parse", "-f", path).CombinedOutput()
	if err != nil {
		return fmt.Errorf("squid -k parse %s: %v\n%s", path, err, out)
	}
	for _, l := range strings.Split(string(out), "\n") {
		// Squid echoes each line it reads, and a line may name an error
		// type (ERR_READ_ERROR): only its own messages count.
		if strings.Contains(l, "| Processing: ") {
			continue
		}
		if strings.Contains(l, "FATAL") || strings.Contains(l, "ERROR") || strings.Contains(l, "is a subnetwork of") {
			return fmt.Errorf("squid -k parse %s: %s\n%s", path, l, out)
		}
	}
	return nil
}

// ParseConf writes the configuration conf to a file in dir and runs
// [Parse] on it.
func ParseConf(squid, dir, conf string) error {
	path := filepath.Join(dir, "squid.conf")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		return err
	}
	return Parse(squid, path)
}
