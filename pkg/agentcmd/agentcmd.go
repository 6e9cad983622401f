// Package agentcmd is the command line every agent that reads a
// configuration file shares: --config and --check-config, the common
// service flags, --recheck-interval, and the life of [service.Command.Serve].
// An agent's main describes itself in a [Spec] and hands it to [Main].
package agentcmd

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agentconfig"
	"proxyfleet/pkg/service"
)

// Spec describes one agent binary whose configuration is a C.
type Spec[C any] struct {
	// Name, Synopsis and About make its --help (see [service.NewCommand]).
	Name, Synopsis, About string
	// ConfigPath is --config's default; empty makes --config required.
	ConfigPath string
	// ConfigHolds says, in --help, what the file holds.
	ConfigHolds string
	// Flags registers the agent's own flags, if it has any.
	Flags func(fs *flag.FlagSet)
	// Load reads and validates the file, reporting every problem.
	Load func(path string) (C, error)
	// Valid is what --check-config prints for a valid file, a line each;
	// nil prints "<path> is valid".
	Valid func(path string, cfg C) []string
	// Serve runs the agent until ctx ends.
	Serve func(ctx context.Context, base *service.Base, cfg C, run Options) error
}

// Options are the parsed flags every agent shares.
type Options struct {
	// RecheckInterval is --recheck-interval, for [agent.Config].
	RecheckInterval time.Duration
	// EgressEndpoints is --egress-allow, for [agent.Config].
	EgressEndpoints []netip.AddrPort
	// KeyDir is --key-dir (default <data-dir>/keys), for [agent.Config].
	KeyDir string
}

// Main parses args, loads the configuration and serves until SIGINT or
// SIGTERM. It returns the exit status: 0 after --help, --check-config of a
// valid file or a clean stop; 2 for a bad flag or configuration (every
// problem on stderr, named by its key); 1 when the agent fails to run.
func Main[C any](s Spec[C], args []string, stderr io.Writer) int {
	cmd := service.NewCommand(s.Name, s.Synopsis, s.About, stderr)
	var cf agentconfig.Flags
	cf.Register(cmd.Flags, s.ConfigPath, s.ConfigHolds)
	recheck := agent.RecheckFlag(cmd.Flags)
	endpoints := agent.EgressFlag(cmd.Flags)
	keyDir := agent.KeyDirFlag(cmd.Flags)
	if s.Flags != nil {
		s.Flags(cmd.Flags)
	}
	if code, ok := cmd.Parse(args); !ok {
		return code
	}
	if cf.Path == "" {
		return cmd.Fail(2, errors.New("--config is required (see --help)"))
	}
	cfg, err := s.Load(cf.Path)
	if err != nil {
		return cmd.Fail(2, err)
	}
	if cf.Check {
		lines := []string{fmt.Sprintf("%s is valid", cf.Path)}
		if s.Valid != nil {
			lines = s.Valid(cf.Path, cfg)
		}
		for _, l := range lines {
			cmd.Printf("%s", l)
		}
		return 0
	}
	return cmd.Serve(func(ctx context.Context, base *service.Base) error {
		return s.Serve(ctx, base, cfg, Options{RecheckInterval: *recheck, EgressEndpoints: *endpoints, KeyDir: agent.KeyDirOr(*keyDir, cmd.Common.DataDir)})
	})
}

// Exit runs [Main] on the process's arguments and exits with its status;
// it is an agent's whole func main.
func Exit[C any](s Spec[C]) { os.Exit(Main(s, os.Args[1:], os.Stderr)) }
