package telemetry

import (
	"context"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
)

// redacted replaces a secret inside a URL's userinfo.
const redacted = "xxxxx"

// userinfo matches the userinfo of every URL in a text: a scheme, "://",
// then everything up to the last "@" before whitespace, a "," (the
// separator of NATS URL lists) or a quote, so that a match never runs into
// the next URL or out of a quoted string. A "/" is allowed: a password
// holding one is not a valid URL, but it is still a secret, and redacting a
// path that holds an "@" costs nothing.
var userinfo = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.\-]*://)([^\s,"'<>@]*(?:@[^\s,"'<>@]*)*)@`)

// RedactURL returns s with the secret of every URL's userinfo replaced:
// "nats://planner:p1@h:4222" becomes "nats://planner:xxxxx@h:4222", and a
// user-only userinfo, which NATS reads as a token ("nats://s3cr3t@h"), becomes
// "nats://xxxxx@h". s may be one URL, a comma-separated list of URLs, or any
// text such as an error message; text without a URL comes back unchanged.
// Call it wherever a URL is logged or put in an error.
func RedactURL(s string) string {
	if !strings.Contains(s, "://") || !strings.Contains(s, "@") {
		return s
	}
	return userinfo.ReplaceAllStringFunc(s, func(m string) string {
		i := strings.Index(m, "://") + len("://")
		scheme, info := m[:i], m[i:len(m)-1]
		if user, _, ok := strings.Cut(info, ":"); ok {
			return scheme + user + ":" + redacted + "@"
		}
		return scheme + redacted + "@"
	})
}

// redactAttr is the logger's safety net behind the callers' own
// [RedactURL]: string, error and Stringer values that carry a URL with a
// secret are logged redacted.
func redactAttr(_ []string, a slog.Attr) slog.Attr {
	switch a.Value.Kind() {
	case slog.KindString:
		if s := a.Value.String(); mayHoldUserinfo(s) {
			a.Value = slog.StringValue(RedactURL(s))
		}
	case slog.KindAny:
		var s string
		switch v := a.Value.Any().(type) {
		case error:
			s = v.Error()
		case fmt.Stringer:
			s = v.String()
		default:
			return a
		}
		if mayHoldUserinfo(s) {
			if r := RedactURL(s); r != s {
				a.Value = slog.StringValue(r)
			}
		}
	}
	return a
}

func mayHoldUserinfo(s string) bool {
	return strings.Contains(s, "://") && strings.Contains(s, "@")
}

// redactHandler redacts the record's message; its attributes go through
// [redactAttr] as the JSON handler's ReplaceAttr.
type redactHandler struct{ slog.Handler }

func (h redactHandler) Handle(ctx context.Context, r slog.Record) error {
	if mayHoldUserinfo(r.Message) {
		r.Message = RedactURL(r.Message)
	}
	return h.Handler.Handle(ctx, r)
}

func (h redactHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return redactHandler{h.Handler.WithAttrs(as)}
}

func (h redactHandler) WithGroup(name string) slog.Handler {
	return redactHandler{h.Handler.WithGroup(name)}
}
