package main

import (
	"bytes"
	"strconv"
	"strings"
	"testing"

	"proxyfleet/pkg/events"
)

// FuzzFlags: the local-agent's configuration is its flags. With an invalid
// --entry (so run never starts serving), any --ports, --bind,
// --source-addrs and --capacity exit 2 with one line per problem: no value
// breaks a line or makes a line of its own.
func FuzzFlags(f *testing.F) {
	f.Add("20000-20999", "127.0.0.1", "", 0)
	f.Add("0", "::1", "10.0.0.1, 10.0.0.2", 4)
	f.Add("30-20", "nowhere", "10.0.0.1,x,10.0.0.1", -1)
	f.Add("1-\n2", "a\nlocal-agent: forged", "x\ny,\n", 0)
	f.Fuzz(func(t *testing.T, ports, bind, sources string, capacity int) {
		var out bytes.Buffer
		code := run([]string{"--entry=Bad_Entry", "--ports=" + ports, "--bind=" + bind, "--source-addrs=" + sources,
			"--capacity=" + strconv.Itoa(capacity), "--nats-url=nats://127.0.0.1:1"}, &out)
		if code != 2 {
			t.Fatalf("exit %d, want 2; output:\n%s", code, &out)
		}
		lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
		if len(lines) < 2 || !strings.HasPrefix(lines[0], name+": --entry: ") || lines[len(lines)-1] != name+": see --help" {
			t.Fatalf("output is not the --entry problem, the others and see --help:\n%s", &out)
		}
		for _, l := range lines {
			if !strings.HasPrefix(l, name+": ") {
				t.Fatalf("line %q is not a problem line of %s; output:\n%s", l, name, &out)
			}
		}
	})
}

// FuzzSanitize: the default --target made from the hostname is always an
// identifier, sanitize is idempotent, and an identifier is kept as is.
func FuzzSanitize(f *testing.F) {
	for _, s := range []string{"Builder-01.example.com", "vm", "---", "", "UPPER_case", strings.Repeat("a", 70), "-a-" + strings.Repeat("b", 61) + "-", "é"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got := sanitize(s)
		if !events.IsIdentifier(got) {
			t.Fatalf("sanitize(%q) = %q, not an identifier", s, got)
		}
		if again := sanitize(got); again != got {
			t.Fatalf("sanitize(%q) = %q, but sanitize(%q) = %q", s, got, got, again)
		}
		if events.IsIdentifier(s) && got != s {
			t.Fatalf("sanitize(%q) = %q; an identifier must be kept", s, got)
		}
	})
}
