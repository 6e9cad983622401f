package service_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/service"
)

func TestCommandParse(t *testing.T) {
	cases := []struct {
		name string
		args []string
		code int
		ok   bool
		want []string
	}{
		{"help", []string{"--help"}, 0, false, []string{"Usage: demo-agent [flags]\n\nServes demos.\n\nFlags:\n", "-nats-url", "demo-agent does not embed a server", "-data-dir", "-demo"}},
		{"no embedding", []string{"--nats-listen", "127.0.0.1:0"}, 2, false, []string{"flag provided but not defined: -nats-listen"}},
		{"bad flag", []string{"--nope"}, 2, false, []string{"flag provided but not defined: -nope"}},
		{"argument", []string{"extra"}, 2, false, []string{`demo-agent: unexpected argument "extra" (see --help)`}},
		{"fine", []string{"--demo", "x"}, 0, true, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var out strings.Builder
			cmd := service.NewCommand("demo-agent", "[flags]", "\nServes demos.\n", &out)
			demo := cmd.Flags.String("demo", "", "a flag of the service's own")
			code, ok := cmd.Parse(c.args)
			if code != c.code || ok != c.ok {
				t.Fatalf("Parse(%q) = %d, %v; want %d, %v", c.args, code, ok, c.code, c.ok)
			}
			for _, w := range c.want {
				if !strings.Contains(out.String(), w) {
					t.Errorf("output lacks %q:\n%s", w, &out)
				}
			}
			if c.ok && *demo != "x" {
				t.Errorf("--demo = %q, want x", *demo)
			}
		})
	}
}

func TestCommandFailAndPrintf(t *testing.T) {
	var out strings.Builder
	cmd := service.NewCommand("demo-agent", "[flags]", "Serves demos.", &out)
	cmd.Printf("%s is valid", "demo.yaml")
	if code := cmd.Fail(2, errors.New("invalid config demo.yaml:\n  entry: is required")); code != 2 {
		t.Errorf("Fail returned %d, want 2", code)
	}
	want := "demo-agent: demo.yaml is valid\ndemo-agent: invalid config demo.yaml:\n  entry: is required\n"
	if out.String() != want {
		t.Errorf("output = %q, want %q", out.String(), want)
	}
}

// TestCommandServe starts the service on a NATS server of the test's and
// checks the exit status follows what run returns.
func TestCommandServe(t *testing.T) {
	srv := bustest.Start(t)
	for _, c := range []struct {
		name string
		err  error
		code int
	}{{"clean stop", nil, 0}, {"failure", errors.New("boom"), 1}} {
		t.Run(c.name, func(t *testing.T) {
			var out strings.Builder
			cmd := service.NewCommand("demo-agent", "[flags]", "Serves demos.", &out)
			if _, ok := cmd.Parse([]string{"--nats-url", srv.ClientURL(), "--data-dir", t.TempDir(), "--log-level", "error"}); !ok {
				t.Fatalf("Parse: %s", &out)
			}
			ran := false
			code := cmd.Serve(func(ctx context.Context, base *service.Base) error {
				ran = base.Conn != nil && base.Log != nil && ctx.Err() == nil
				return c.err
			})
			if !ran || code != c.code {
				t.Errorf("Serve = %d (run called with a live base: %v), want %d; output:\n%s", code, ran, c.code, &out)
			}
		})
	}
}

// TestCommandServeNeedsAServer: a command never embeds NATS, so without a
// URL or a context it stops before starting anything, with a usage error
// that names the flags.
func TestCommandServeNeedsAServer(t *testing.T) {
	t.Setenv("NATS_URL", "")
	t.Setenv("NATS_CONTEXT", "")
	var out strings.Builder
	cmd := service.NewCommand("demo-agent", "[flags]", "Serves demos.", &out)
	dataDir := t.TempDir()
	if _, ok := cmd.Parse([]string{"--data-dir", dataDir, "--log-level", "error"}); !ok {
		t.Fatalf("Parse: %s", &out)
	}
	ran := false
	code := cmd.Serve(func(context.Context, *service.Base) error { ran = true; return nil })
	want := "demo-agent: --nats-url or --nats-context is required (env NATS_URL, NATS_CONTEXT): demo-agent does not embed a NATS server; the planner does\n"
	if code != 2 || ran || out.String() != want {
		t.Errorf("Serve = %d (ran: %v), output %q; want 2, not run, %q", code, ran, out.String(), want)
	}
	if entries, _ := os.ReadDir(dataDir); len(entries) != 0 {
		t.Errorf("the data directory holds %d entries; nothing should have started", len(entries))
	}
}

// TestCommandServeSignalDuringStart: SIGTERM while run is still starting
// ends run with an error wrapping the cancelled context; that is a clean
// stop (0), while the same error without a signal is a failure (1).
func TestCommandServeSignalDuringStart(t *testing.T) {
	srv := bustest.Start(t)
	for _, c := range []struct {
		name   string
		signal bool
		code   int
	}{{"after SIGTERM", true, 0}, {"without a signal", false, 1}} {
		t.Run(c.name, func(t *testing.T) {
			var out strings.Builder
			cmd := service.NewCommand("demo-agent", "[flags]", "Serves demos.", &out)
			if _, ok := cmd.Parse([]string{"--nats-url", srv.ClientURL(), "--data-dir", t.TempDir(), "--log-level", "error"}); !ok {
				t.Fatalf("Parse: %s", &out)
			}
			code := cmd.Serve(func(ctx context.Context, base *service.Base) error {
				if !c.signal {
					return fmt.Errorf("open the driver: %w", context.Canceled)
				}
				if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
					t.Error(err)
				}
				<-ctx.Done()
				return fmt.Errorf("open the driver: %w", ctx.Err())
			})
			if code != c.code {
				t.Errorf("Serve = %d, want %d; output:\n%s", code, c.code, &out)
			}
		})
	}
}

// TestCommandServeWritesACPUProfile: with --cpuprofile the service writes
// a CPU profile that go tool pprof reads (gzipped protocol buffers), ended
// and complete once Serve returned.
func TestCommandServeWritesACPUProfile(t *testing.T) {
	srv := bustest.Start(t)
	profile := filepath.Join(t.TempDir(), "demo.pprof")
	var out strings.Builder
	cmd := service.NewCommand("demo-agent", "[flags]", "Serves demos.", &out)
	if _, ok := cmd.Parse([]string{"--nats-url", srv.ClientURL(), "--data-dir", t.TempDir(), "--log-level", "error", "--cpuprofile", profile}); !ok {
		t.Fatalf("Parse: %s", &out)
	}
	code := cmd.Serve(func(ctx context.Context, base *service.Base) error {
		// Some work for the profiler to sample.
		deadline := time.Now().Add(50 * time.Millisecond)
		for n := 0; time.Now().Before(deadline); n++ {
			_ = strconv.Itoa(n)
		}
		return nil
	})
	if code != 0 {
		t.Fatalf("Serve = %d, want 0; output:\n%s", code, &out)
	}
	b, err := os.ReadFile(profile)
	if err != nil {
		t.Fatalf("the profile: %v", err)
	}
	// A gzip stream, as runtime/pprof writes it, that decompresses whole:
	// a profile cut short by a stop that did not end it would not.
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatalf("the profile (%d bytes) is not gzipped: %v", len(b), err)
	}
	if n, err := io.Copy(io.Discard, zr); err != nil || n == 0 {
		t.Fatalf("the profile decompresses to %d bytes: %v", n, err)
	}
}

// TestCommandHelpNamesCPUProfile: --cpuprofile is in every service's
// --help.
func TestCommandHelpNamesCPUProfile(t *testing.T) {
	var out strings.Builder
	cmd := service.NewCommand("demo-agent", "[flags]", "Serves demos.", &out)
	if code, ok := cmd.Parse([]string{"--help"}); ok || code != 0 {
		t.Fatalf("Parse(--help) = %d, %v; want 0, false", code, ok)
	}
	if !strings.Contains(out.String(), "-cpuprofile") {
		t.Errorf("--help does not name --cpuprofile:\n%s", &out)
	}
}
