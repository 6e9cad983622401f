package squidtest_test

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"proxyfleet/pkg/squidtest"
)

// fakeSquid writes a shell script that answers `-k parse -f path` with
// out and exits with code.
func fakeSquid(t *testing.T, out string, code int) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "squid")
	script := "#!/bin/sh\nprintf '%s\\n' '" + out + "'\nexit " + strconv.Itoa(code) + "\n"
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestParse(t *testing.T) {
	cases := []struct {
		name, out string
		code      int
		ok        bool
	}{
		{"clean", "2025/01/01| Processing: http_port 3128", 0, true},
		{"exit status", "bad", 1, false},
		{"fatal", "FATAL: Bungled squid.conf line 3", 0, false},
		{"error", "ERROR: unknown directive", 0, false},
	}
	for _, c := range cases {
		err := squidtest.ParseConf(fakeSquid(t, c.out, c.code), t.TempDir(), "http_port 3128\n")
		if (err == nil) != c.ok {
			t.Errorf("%s: ParseConf = %v, want ok=%v", c.name, err, c.ok)
		}
		if err != nil && !strings.Contains(err.Error(), c.out) {
			t.Errorf("%s: error %q does not carry squid's output %q", c.name, err, c.out)
		}
	}
}

func TestParseConfWritesTheConf(t *testing.T) {
	dir := t.TempDir()
	if err := squidtest.ParseConf(fakeSquid(t, "", 0), dir, "http_port 3128\n"); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "squid.conf")); err != nil || string(b) != "http_port 3128\n" {
		t.Fatalf("squid.conf = %q, %v; want the conf", b, err)
	}
}
