// Command console is proxyfleet's operator console: a web server of
// pages about the fleet (pools, proxies, targets, the event log's
// decisions, the gateways' traffic), updated live, with the operator's
// actions behind a confirmation (docs/console.md).
package main

import (
	"bufio"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/rungroup"
	"proxyfleet/pkg/service"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/console/internal/access"
	"proxyfleet/services/console/internal/fleetview"
	"proxyfleet/services/console/internal/tail"
	"proxyfleet/services/console/internal/traffic"
	"proxyfleet/services/console/internal/web"
)

const usage = `console serves proxyfleet's operator console: the fleet, each pool and
its proxies, the targets, the event log's decisions and the gateways'
traffic, live in a browser, with scale, recycle, report-ban and delete
behind a confirmation. It reads the KV views and the request log and acts
through the operator API.

Usage:
  console --nats-url nats://127.0.0.1:4222 [--listen 127.0.0.1:8090]
  console --nats-context ctx.json --listen 0.0.0.0:8090 --users users.txt
  console --hash-password < password.txt    print the bcrypt hash of the
                                            password on stdin, for a users file

Without --users the console lets every visitor act without signing in,
and so listens only on loopback. The users file holds one user a line,
name:role:bcrypt-hash, role viewer or operator.

Flags:
`

type flags struct {
	base         service.Flags
	listen       string
	usersFile    string
	pageSize     int
	historyEvery time.Duration
	tailSize     int
	hashPassword bool
	tlsCert      string
	tlsKey       string
	users        access.Users
	tls          *tls.Config
}

func parse(args []string) (*flags, error) {
	var f flags
	fs := service.NewFlagSet("console", usage)
	f.base.Register(fs, "console")
	fs.StringVar(&f.listen, "listen", "127.0.0.1:8090", "serve the console at this address (host:port; port 0 picks a free one); beyond loopback --users is required")
	fs.StringVar(&f.usersFile, "users", "", "users file: one user a line, name:role:bcrypt-hash with role viewer or operator (console --hash-password makes hashes); empty: no sign-in, every visitor is an operator, loopback only")
	fs.IntVar(&f.pageSize, "page-size", 100, "proxies on one page of a pool (1-1000)")
	fs.DurationVar(&f.historyEvery, "history-every", 10*time.Second, "time between two points of each pool's history of ready against desired (60 points are kept)")
	fs.IntVar(&f.tailSize, "tail", 1000, "events of the log the events page keeps (100-100000)")
	fs.StringVar(&f.tlsCert, "tls-cert", "", "serve HTTPS with this certificate (PEM, with its chain), with --tls-key; browsers keep the session cookie (Secure) only over HTTPS or on localhost")
	fs.StringVar(&f.tlsKey, "tls-key", "", "private key of --tls-cert (PEM)")
	fs.BoolVar(&f.hashPassword, "hash-password", false, "read a password from stdin (one line), print its bcrypt hash for a users file line, and exit")
	if err := service.ParseFlags(fs, args); err != nil {
		return nil, err
	}
	if f.hashPassword {
		return &f, nil
	}
	if f.pageSize < 1 || f.pageSize > 1000 {
		return nil, fmt.Errorf("--page-size %d: want 1 to 1000", f.pageSize)
	}
	if f.historyEvery < time.Second {
		return nil, fmt.Errorf("--history-every %s: want at least 1s", f.historyEvery)
	}
	if f.tailSize < 100 || f.tailSize > 100_000 {
		return nil, fmt.Errorf("--tail %d: want 100 to 100000", f.tailSize)
	}
	if (f.tlsCert == "") != (f.tlsKey == "") {
		return nil, errors.New("--tls-cert and --tls-key go together: give both or neither")
	}
	if f.tlsCert != "" {
		cert, err := tls.LoadX509KeyPair(f.tlsCert, f.tlsKey)
		if err != nil {
			return nil, fmt.Errorf("--tls-cert %s, --tls-key %s: %w", f.tlsCert, f.tlsKey, err)
		}
		f.tls = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	}
	loopback, err := web.IsLoopback(f.listen)
	if err != nil {
		return nil, fmt.Errorf("--listen %q: want host:port, e.g. 127.0.0.1:8090", f.listen)
	}
	if f.usersFile != "" {
		if f.users, err = access.LoadUsers(f.usersFile); err != nil {
			return nil, fmt.Errorf("--users: %w", err)
		}
	} else if !loopback {
		return nil, fmt.Errorf("--listen %s is not loopback: give --users FILE (name:role:bcrypt-hash lines), or listen on 127.0.0.1; without users every visitor could act on the fleet", f.listen)
	}
	return &f, nil
}

func main() {
	os.Exit(service.Main("console", os.Args[1:], os.Stderr, parse, func(f *flags) error { return run(f, os.Stdin, os.Stdout) }))
}

// hash reads one line from in and writes its bcrypt hash to out.
func hash(in io.Reader, out io.Writer) error {
	line, err := bufio.NewReader(in).ReadString('\n')
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("read the password from stdin: %w", err)
	}
	password := strings.TrimRight(line, "\r\n")
	if password == "" {
		return errors.New("--hash-password: no password on stdin (one line)")
	}
	h, err := access.HashPassword(password)
	if err != nil {
		return fmt.Errorf("--hash-password: %w", err)
	}
	_, err = fmt.Fprintln(out, h)
	return err
}

func run(f *flags, stdin io.Reader, stdout io.Writer) error {
	if f.hashPassword {
		return hash(stdin, stdout)
	}
	ctx, stop := rungroup.SignalContext()
	defer stop()
	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", f.listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	scheme := "http"
	if f.tls != nil {
		ln, scheme = tls.NewListener(ln, f.tls), "https"
	}
	base, err := service.Start(ctx, "console", f.base)
	if err != nil {
		_ = ln.Close()
		return err
	}
	defer base.Close()
	log := base.Log
	if loopback, _ := web.IsLoopback(f.listen); !loopback && f.tls == nil {
		log.Warn("serving plain HTTP beyond loopback: browsers keep the session cookie (Secure) only over HTTPS, so signing in fails; give --tls-cert and --tls-key, or serve it behind a TLS proxy")
	}

	store := fleetview.New()
	stats := traffic.New()
	events := tail.New(f.tailSize, store.PoolOf)
	srv, err := web.New(web.Config{
		Store: store, Traffic: stats, Tail: events, API: api.NewClient(base.Conn.NC),
		Users: f.users, PageSize: f.pageSize, HistoryEvery: f.historyEvery,
		Log: log, Meter: base.Tel.Meter,
	})
	if err != nil {
		_ = ln.Close()
		return err
	}
	// No WriteTimeout: the live streams last as long as their pages.
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute}
	hs.RegisterOnShutdown(srv.OnShutdown)

	g := rungroup.Group{Log: log}
	g.Add(
		rungroup.Member{Name: "views", Run: fleetview.NewFollower(base.Conn.JS, store, f.historyEvery, log).Run},
		rungroup.Member{Name: "events", Run: tail.NewFollower(base.Conn, events, uint64(f.tailSize), log).Run},
		rungroup.Member{Name: "traffic", Run: traffic.NewFollower(base.Conn.JS, stats, log).Run},
		rungroup.HTTP("http", hs, ln, 5*time.Second),
	)
	mode := "users file " + f.usersFile
	if f.users == nil {
		mode = "open on loopback: no sign-in, every visitor is an operator"
	}
	log.Info("console serving", "listen", ln.Addr().String(), "addr", ln.Addr().String(), "url", scheme+"://"+ln.Addr().String()+"/", "access", mode,
		"nats", telemetry.RedactURL(base.Conn.ClientURL()))
	if err := g.Run(ctx); err != nil {
		return err
	}
	log.Info("console stopped")
	return nil
}
