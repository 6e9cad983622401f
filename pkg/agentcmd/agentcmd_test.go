package agentcmd_test

import (
	"context"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agentcmd"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/service"
)

type conf struct{ Zone string }

// spec is a small agent whose file must read "zone: <name>".
func spec(served *conf, opts *agentcmd.Options, level *string) agentcmd.Spec[conf] {
	return agentcmd.Spec[conf]{
		Name: "demo-agent", Synopsis: "[flags]", About: "Serves demos in one zone.",
		ConfigHolds: "the zone",
		Flags:       func(fs *flag.FlagSet) { fs.StringVar(level, "demo-level", "low", "how loud the demo is") },
		Load: func(path string) (conf, error) {
			b, err := os.ReadFile(path)
			if err != nil {
				return conf{}, err
			}
			zone, ok := strings.CutPrefix(strings.TrimSpace(string(b)), "zone: ")
			if !ok || zone == "" {
				return conf{}, errors.New(path + ": zone: is required")
			}
			return conf{Zone: zone}, nil
		},
		Serve: func(ctx context.Context, base *service.Base, cfg conf, o agentcmd.Options) error {
			if base.Conn == nil || ctx.Err() != nil {
				return errors.New("served without a live base")
			}
			*served, *opts = cfg, o
			return nil
		},
	}
}

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "agent.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestMainExitCodesAndOutput(t *testing.T) {
	t.Setenv("NATS_URL", "")
	t.Setenv("NATS_CONTEXT", "")
	srv := bustest.Start(t)
	good, bad := writeFile(t, "zone: z1\n"), writeFile(t, "zone: \n")
	for _, c := range []struct {
		name    string
		args    []string
		code    int
		out     []string
		noServe bool
	}{
		{"help", []string{"--help"}, 0, []string{"Usage: demo-agent [flags]", "Serves demos in one zone.", "-config", "the zone", "-check-config", "-recheck-interval", "-demo-level", "-nats-url"}, true},
		{"no config", nil, 2, []string{"demo-agent: --config is required (see --help)"}, true},
		{"bad flag", []string{"--config", good, "--recheck-interval", "soon"}, 2, []string{"recheck-interval"}, true},
		{"bad config", []string{"--config", bad}, 2, []string{"demo-agent: " + bad + ": zone: is required"}, true},
		{"missing file", []string{"--config", bad + ".gone"}, 2, []string{"no such file"}, true},
		{"check valid", []string{"--config", good, "--check-config"}, 0, []string{"demo-agent: " + good + " is valid"}, true},
		{"no server", []string{"--config", good, "--data-dir", t.TempDir()}, 2, []string{"demo-agent: --nats-url or --nats-context is required"}, true},
		{"serve", []string{"--config", good, "--recheck-interval", "7s", "--demo-level", "high", "--data-dir", t.TempDir(),
			"--nats-url", srv.ClientURL(), "--log-level", "error"}, 0, nil, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			var out strings.Builder
			var served conf
			var opts agentcmd.Options
			var level string
			code := agentcmd.Main(spec(&served, &opts, &level), c.args, &out)
			if code != c.code {
				t.Fatalf("exit %d, want %d; output:\n%s", code, c.code, &out)
			}
			for _, w := range c.out {
				if !strings.Contains(out.String(), w) {
					t.Errorf("output lacks %q:\n%s", w, &out)
				}
			}
			if c.noServe {
				if served != (conf{}) {
					t.Errorf("served %+v; want no serving", served)
				}
				return
			}
			if served.Zone != "z1" || opts.RecheckInterval != 7*time.Second || level != "high" {
				t.Errorf("served %+v with %+v and level %q; want zone z1, recheck 7s, level high", served, opts, level)
			}
		})
	}
}

func TestMainCheckPrintsTheAgentsLines(t *testing.T) {
	good := writeFile(t, "zone: z1\n")
	var served conf
	var opts agentcmd.Options
	var level string
	s := spec(&served, &opts, &level)
	s.Valid = func(_ string, cfg conf) []string { return []string{"zone " + cfg.Zone, "one target"} }
	var out strings.Builder
	if code := agentcmd.Main(s, []string{"--config", good, "--check-config"}, &out); code != 0 {
		t.Fatalf("exit %d: %s", code, &out)
	}
	if want := "demo-agent: zone z1\ndemo-agent: one target\n"; out.String() != want {
		t.Errorf("output %q, want %q", out.String(), want)
	}
}
