package replica

import (
	"regexp"
	"strings"
	"testing"
)

func TestID(t *testing.T) {
	long := strings.Repeat("h", 80)
	for _, tc := range []struct{ host, service, suffix, want string }{
		{"node1", "health", "4242", "node1-4242"},
		{"node1.example.com", "planner", "17", "node1-example-com-17"},
		{"Web_01", "gateway", "8888", "Web_01-8888"},
		{"bad host/é", "gateway", "8888", "bad-host----8888"},
		{"", "health", "1", "health-1"},
		{long, "gateway", "65535", strings.Repeat("h", 50) + "-65535"},
	} {
		if got := id(tc.host, tc.service, tc.suffix); got != tc.want {
			t.Errorf("id(%q, %q, %q) = %q, want %q", tc.host, tc.service, tc.suffix, got, tc.want)
		}
	}
}

// TestIDFitsEveryUse: the default id is valid wherever a service uses it:
// a gateway name (1-64 letters, digits, '-', '_') and a health replica id
// (a KV key).
func TestIDFitsEveryUse(t *testing.T) {
	gatewayName := regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)
	for _, suffix := range []string{PID(), "65535"} {
		if got := ID("gateway", suffix); !gatewayName.MatchString(got) {
			t.Errorf("ID(gateway, %s) = %q: not a valid gateway name", suffix, got)
		}
	}
	if got := ID("health", PID()); !strings.HasSuffix(got, "-"+PID()) {
		t.Errorf("ID(health, PID()) = %q, want it to end with -%s", got, PID())
	}
}
