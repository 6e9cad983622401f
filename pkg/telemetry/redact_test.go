package telemetry_test

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"testing"

	"proxyfleet/pkg/telemetry"
)

func TestRedactURL(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"nats://planner:p1@10.0.0.1:4222", "nats://planner:xxxxx@10.0.0.1:4222"},
		{"nats://s3cr3t-token@h:4222", "nats://xxxxx@h:4222"},
		{"nats://a:pw1@h1:4222,nats://b:pw2@h2:4222", "nats://a:xxxxx@h1:4222,nats://b:xxxxx@h2:4222"},
		{"tls://u:p@ss:w0rd@h", "tls://u:xxxxx@h"},
		{"nats://u:pa/ss@h:4222", "nats://u:xxxxx@h:4222"},
		{"connect to NATS at nats://u:hunter2@h:4222: nats: Authorization Violation", "connect to NATS at nats://u:xxxxx@h:4222: nats: Authorization Violation"},
		{`{"url":"https://u:pw@h/x"}`, `{"url":"https://u:xxxxx@h/x"}`},
		{"nats://127.0.0.1:4222", "nats://127.0.0.1:4222"},
		{"mail ops@example.org about http://h/x", "mail ops@example.org about http://h/x"},
		{"", ""},
	} {
		if got := telemetry.RedactURL(c.in); got != c.want {
			t.Errorf("RedactURL(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

type urlStringer struct{ u *url.URL }

func (s urlStringer) String() string { return s.u.String() }

// TestLoggerRedactsURLs: whatever a caller forgets to redact, the logger
// does not print a URL's password or token, at debug level, in messages,
// attributes, With attributes, groups, errors and Stringers.
func TestLoggerRedactsURLs(t *testing.T) {
	var buf bytes.Buffer
	log := telemetry.NewLogger(&buf, slog.LevelDebug, "svc").With("nats", "nats://planner:pw-with@h:4222")
	u, _ := url.Parse("nats://agent:pw-stringer@h:4222")
	log.Debug("dial nats://tok-in-message@h:4222",
		"url", "nats://u:pw-attr@h:4222",
		"err", fmt.Errorf("connect: %w", errors.New("at nats://u:pw-error@h")),
		"stringer", urlStringer{u},
		slog.Group("g", "url", "tls://u:pw-group@h"))
	out := buf.String()
	for _, secret := range []string{"pw-with", "pw-stringer", "tok-in-message", "pw-attr", "pw-error", "pw-group"} {
		if strings.Contains(out, secret) {
			t.Errorf("log output holds %q:\n%s", secret, out)
		}
	}
	for _, want := range []string{"nats://planner:xxxxx@h:4222", "dial nats://xxxxx@h:4222", "nats://agent:xxxxx@h:4222", "tls://u:xxxxx@h"} {
		if !strings.Contains(out, want) {
			t.Errorf("log output lacks %q:\n%s", want, out)
		}
	}
}
