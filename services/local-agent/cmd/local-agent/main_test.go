package main

import (
	"bytes"
	"strings"
	"testing"
)

func TestInvalidFlagsExit2WithOneLinePerProblem(t *testing.T) {
	var out bytes.Buffer
	code := run([]string{"--entry", "Bad_Entry", "--ports", "30-20", "--bind", "nowhere", "--source-addrs", "10.0.0.1,x", "--capacity", "-1"}, &out)
	if code != 2 {
		t.Fatalf("exit %d, want 2; output:\n%s", code, &out)
	}
	for _, want := range []string{"--entry", "--ports", `bind "nowhere"`, `source address "x"`, "capacity -1"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks a line about %s:\n%s", want, &out)
		}
	}
}

func TestHelpExplainsFlags(t *testing.T) {
	var out bytes.Buffer
	if code := run([]string{"--help"}, &out); code != 0 {
		t.Fatalf("--help exit %d, want 0", code)
	}
	for _, flag := range []string{"-entry", "-target", "-ports", "-bind", "-source-addrs", "-state-dir", "-squid", "-capacity", "-nats-url", "-data-dir"} {
		if !strings.Contains(out.String(), flag) {
			t.Errorf("--help lacks %s", flag)
		}
	}
	out.Reset()
	if code := run([]string{"proxy", "--help"}, &out); code != 0 || !strings.Contains(out.String(), "-auth-file") {
		t.Errorf("proxy --help exit %d, output:\n%s", code, &out)
	}
}

func TestProxyInvalidFlags(t *testing.T) {
	var out bytes.Buffer
	if code := run([]string{"proxy", "--listen", "nope", "--source-addr", "x"}, &out); code != 2 {
		t.Fatalf("exit %d, want 2; output:\n%s", code, &out)
	}
	if n := strings.Count(out.String(), "\n"); n != 2 {
		t.Errorf("%d lines, want one per problem (2):\n%s", n, &out)
	}
}

func TestSanitize(t *testing.T) {
	cases := map[string]string{
		"Builder-01.example.com": "builder-01-example-com",
		"vm":                     "vm",
		"---":                    "local",
		"":                       "local",
		"UPPER_case":             "upper-case",
		strings.Repeat("a", 70):  strings.Repeat("a", 63),
	}
	for in, want := range cases {
		if got := sanitize(in); got != want {
			t.Errorf("sanitize(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestProxyRejectsStrayArguments(t *testing.T) {
	var out bytes.Buffer
	if code := run([]string{"proxy", "--listen", "127.0.0.1:0", "stray"}, &out); code != 2 {
		t.Fatalf("exit %d, want 2; output:\n%s", code, &out)
	}
	if want := `local-agent proxy: unexpected argument "stray" (see --help)`; !strings.Contains(out.String(), want) {
		t.Errorf("output lacks %q:\n%s", want, &out)
	}
}
