package service

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"

	"proxyfleet/pkg/rungroup"
)

// Command is the command line of one agent binary: the common [Flags]
// (without embedding: agents connect to the planner's or the operator's
// NATS server) and the agent's own, a --help that explains the service, and the
// run-until-signal life of [Command.Serve]. A cmd/<svc>/main.go registers
// its own flags on [Command.Flags], parses, loads its configuration and
// hands its composition to Serve.
type Command struct {
	Name   string
	Flags  *flag.FlagSet
	Common Flags
	stderr io.Writer
}

// NewCommand returns the command line of service name, writing to stderr,
// with the common flags registered. --help prints "Usage: <name>
// <synopsis>", the about text, and every flag.
func NewCommand(name, synopsis, about string, stderr io.Writer) *Command {
	c := &Command{Name: name, Flags: flag.NewFlagSet(name, flag.ContinueOnError), stderr: stderr}
	c.Flags.SetOutput(stderr)
	c.Common.Register(c.Flags, name)
	c.Flags.Usage = func() {
		fmt.Fprintf(stderr, "Usage: %s %s\n\n%s\n\nFlags:\n", name, synopsis, strings.TrimSpace(about))
		c.Flags.PrintDefaults()
	}
	return c
}

// Parse parses args as [ParseArgs] does. When ok is false the caller
// returns code: 0 after --help, 2 for a bad flag or argument.
func (c *Command) Parse(args []string) (code int, ok bool) {
	return ParseArgs(c.Flags, args, c.stderr)
}

// Fail reports err on stderr as "<name>: <err>" and returns code, the exit
// status: 2 for a usage or configuration problem, 1 for a failure to run.
func (c *Command) Fail(code int, err error) int {
	fmt.Fprintf(c.stderr, "%s: %v\n", c.Name, err)
	return code
}

// Printf writes one line of the command's own output on stderr, prefixed
// with its name.
func (c *Command) Printf(format string, args ...any) {
	fmt.Fprintf(c.stderr, "%s: %s\n", c.Name, fmt.Sprintf(format, args...))
}

// Serve runs the service until SIGINT or SIGTERM: it starts the logger,
// telemetry and NATS ([Start]), runs run as the one member of a
// [rungroup.Group] (its context ends on the signal), and closes them when run
// returns. The exit status is 0 when run returns nil or ends with the
// cancelled context after the signal, 1 when start-up or run fails, or run
// does not return within the group's stop bound (the error is logged), and
// 2 when no NATS server is given (a [Command] never embeds one).
func (c *Command) Serve(run func(ctx context.Context, base *Base) error) int {
	if err := c.Common.needServer(c.Name); err != nil {
		return c.Fail(2, err)
	}
	ctx, stop := rungroup.SignalContext()
	defer stop()
	base, err := Start(ctx, c.Name, c.Common)
	if err != nil {
		return c.Fail(1, err)
	}
	defer base.Close()
	g := rungroup.Group{Log: base.Log}
	g.Go(c.Name, func(ctx context.Context) error { return run(ctx, base) })
	if err := g.Run(ctx); err != nil {
		base.Log.Error("stopped", "err", err)
		return 1
	}
	return 0
}
