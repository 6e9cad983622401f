package main

import (
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/rungroup"
	"proxyfleet/pkg/service"
	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/local-agent/internal/forwardproxy"
)

// runProxy is "local-agent proxy": one built-in forward proxy in the
// foreground until SIGTERM or SIGINT.
func runProxy(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet(name+" proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", "", "HOST:PORT to listen on (required)")
	listenFD := fs.Int("listen-fd", 0, "inherited descriptor of a socket already listening on --listen, to serve on instead of binding (the agent holds the port from its choice to the proxy's start)")
	authFile := fs.String("auth-file", "", "file with one line username:password, mode 0600; clients must send these credentials (Proxy-Authorization: Basic)")
	source := fs.String("source-addr", "", "source IP address of outgoing connections (empty: the system's choice)")
	logLevel := fs.String("log-level", "info", "log level: debug, info, warn or error")
	bodyTimeout := fs.Duration("body-timeout", 30*time.Second, "how long a request body may go without a byte arriving before the request is answered 408")
	tunnelIdle := fs.Duration("tunnel-idle-timeout", 2*time.Minute, "a CONNECT tunnel that carries nothing either way for this long is closed")
	allowEndpoints := fs.String("egress-allow", "", "comma-separated ip:port destinations always allowed (the health echo endpoint)")
	allowCIDRs := fs.String("egress-allow-cidrs", "", "comma-separated destination ranges allowed despite the egress policy (10.1.0.0/16)")
	allowPorts := fs.String("egress-allow-ports", "", "comma-separated ports allowed for CONNECT and plain HTTP beside 443 (and 80)")
	fs.Usage = func() {
		fmt.Fprintf(stderr, `Usage: %s proxy --listen HOST:PORT [--auth-file FILE] [--source-addr IP] [--egress-allow IP:PORT]

Runs one forward HTTP proxy (absolute-URI requests and CONNECT tunnels) in
the foreground. It refuses loopback, link-local, private and this host's
addresses, and ports other than 443 (80 and 443 for plain HTTP), unless the
--egress-* flags allow them. The password is read from a file, never from the command
line, which every user can see.

Flags:
`, name)
		fs.PrintDefaults()
	}
	if code, ok := service.ParseArgs(fs, args, stderr); !ok {
		return code
	}
	var problems []string
	if _, _, err := net.SplitHostPort(*listen); err != nil {
		problems = append(problems, fmt.Sprintf("--listen %q: want HOST:PORT", *listen))
	}
	cfg := forwardproxy.Config{BodyTimeout: *bodyTimeout, TunnelIdleTimeout: *tunnelIdle}
	if *bodyTimeout <= 0 || *tunnelIdle <= 0 {
		problems = append(problems, "--body-timeout and --tunnel-idle-timeout must be more than 0")
	}
	if *source != "" {
		if cfg.SourceAddr = net.ParseIP(*source); cfg.SourceAddr == nil {
			problems = append(problems, fmt.Sprintf("--source-addr %q: want an IP address", *source))
		}
	}
	if *authFile != "" {
		creds, err := forwardproxy.ReadAuthFile(*authFile)
		if err != nil {
			problems = append(problems, fmt.Sprintf("--auth-file: %v", err))
		}
		cfg.Auth = creds
	}
	pol, err := parseEgress(*allowEndpoints, *allowCIDRs, *allowPorts)
	if err != nil {
		problems = append(problems, err.Error())
	}
	cfg.Egress = pol
	level, err := telemetry.ParseLevel(*logLevel)
	if err != nil {
		problems = append(problems, fmt.Sprintf("--log-level %q: want debug, info, warn or error", *logLevel))
	}
	if len(problems) > 0 {
		for _, p := range problems {
			fmt.Fprintf(stderr, "%s proxy: %s\n", name, p)
		}
		return 2
	}
	log := telemetry.NewLogger(stderr, level, name+"-proxy")
	cfg.Log = log

	ln, err := listener(*listen, *listenFD)
	if err != nil {
		log.Error("listen", "err", err)
		return 1
	}
	srv := forwardproxy.Server(forwardproxy.New(cfg))
	ctx, stop := rungroup.SignalContext()
	defer stop()
	g := rungroup.Group{Log: log}
	g.Add(rungroup.HTTP("proxy", srv, ln, 2*time.Second))
	log.Info("proxy listening", "addr", ln.Addr().String(), "auth", cfg.Auth != nil, "source_addr", *source)
	if err := g.Run(ctx); err != nil {
		log.Error("serve", "err", err)
		return 1
	}
	log.Info("proxy stopped")
	return 0
}

// parseEgress reads the --egress-* flags into a policy.
func parseEgress(endpoints, cidrs, ports string) (egress.Policy, error) {
	eps, err := egress.ParseEndpoints(strings.Split(endpoints, ","))
	if err != nil {
		return egress.Policy{}, fmt.Errorf("--egress-allow: %w", err)
	}
	var nums []int
	for _, s := range splitList(ports) {
		n, err := strconv.Atoi(s)
		if err != nil {
			return egress.Policy{}, fmt.Errorf("--egress-allow-ports %q: want port numbers", ports)
		}
		nums = append(nums, n)
	}
	pol, err := egress.Compile(splitList(cidrs), nums, eps)
	if err != nil {
		return egress.Policy{}, fmt.Errorf("--egress-allow-cidrs/--egress-allow-ports: %w", err)
	}
	return pol, nil
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// listener is the inherited listening socket fd when fd > 0, or a new one
// on addr.
func listener(addr string, fd int) (net.Listener, error) {
	if fd <= 0 {
		return net.Listen("tcp", addr)
	}
	f := os.NewFile(uintptr(fd), "listener")
	defer f.Close() // FileListener holds its own copy
	return net.FileListener(f)
}
