// Package service is the start-up every proxyfleet binary shares: the common
// flags (NATS, data directory, logging, metrics), the JSON logger, telemetry,
// the NATS connection and the stream topology. Each cmd/<svc>/main.go
// composes it with its own adapters and runs them in a [rungroup.Group].
package service

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime/pprof"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/telemetry"
)

// Flags are the options every service accepts.
type Flags struct {
	NATSURL     string
	NATSContext string
	NATSCreds   string
	NATSNKey    string
	NATSCA      string
	NATSCert    string
	NATSKey     string
	NATSInbox   string
	DataDir     string
	Listen      string
	Replicas    int
	LogLevel    string
	MetricsAddr string
	// EnsureTopology creates or updates streams and buckets at start. Turn it
	// off for services whose NATS user may not (agents under least privilege).
	EnsureTopology bool
	// Embed starts the NATS server this service embeds when given neither
	// --nats-url nor --nats-context (embedded.Start, for the planner and
	// health). It is set before [Flags.Register]; nil means the service
	// never embeds, has no --nats-listen, and needs a URL or a context.
	Embed bus.EmbedFunc
	// NATSServerConfig is the embedded server's nats-server configuration
	// file (--nats-server-config): authentication for a listener beyond
	// loopback.
	NATSServerConfig string
	// CPUProfile is the file a CPU profile of the process is written to
	// (--cpuprofile), from the end of [Start] until [Base.Close].
	CPUProfile string
}

// Register adds the common flags to fs. Environment variables give the
// defaults: NATS_URL, NATS_CONTEXT, NATS_CREDS, NATS_NKEY, NATS_CA,
// NATS_CERT, NATS_KEY, PROXYFLEET_DATA_DIR, PROXYFLEET_LOG_LEVEL.
func (f *Flags) Register(fs *flag.FlagSet, service string) {
	if f.Embed != nil {
		fs.StringVar(&f.NATSURL, "nats-url", os.Getenv("NATS_URL"),
			"NATS server URL(s), comma separated; empty (and no --nats-context) embeds a JetStream server (env NATS_URL)")
		fs.StringVar(&f.DataDir, "data-dir", envOr("PROXYFLEET_DATA_DIR", ".run/"+service),
			"directory for this service's state; the embedded server stores JetStream under <data-dir>/jetstream (env PROXYFLEET_DATA_DIR)")
		fs.StringVar(&f.Listen, "nats-listen", "",
			"client address of the embedded NATS server (only without --nats-url); default "+bus.DefaultListen+", or the listen of --nats-server-config; port 0 picks a free port, written to <data-dir>/<program>_<pid>.ports; an address other than loopback needs --nats-server-config with users")
		fs.StringVar(&f.NATSServerConfig, "nats-server-config", "",
			"nats-server configuration file for the embedded server (authorization, accounts, TLS; JetStream stays under <data-dir>/jetstream); required to listen beyond loopback, with users or nkeys defined")
	} else {
		fs.StringVar(&f.NATSURL, "nats-url", os.Getenv("NATS_URL"),
			"NATS server URL(s), comma separated; this or --nats-context is required: "+service+" does not embed a server (env NATS_URL)")
		fs.StringVar(&f.DataDir, "data-dir", envOr("PROXYFLEET_DATA_DIR", ".run/"+service),
			"directory for this service's state (env PROXYFLEET_DATA_DIR)")
	}
	fs.StringVar(&f.NATSContext, "nats-context", os.Getenv("NATS_CONTEXT"),
		"nats CLI context (name or path of its JSON file) giving the URL and credentials (env NATS_CONTEXT)")
	fs.StringVar(&f.NATSCreds, "nats-creds", os.Getenv("NATS_CREDS"),
		"NATS credentials file used with --nats-url (env NATS_CREDS)")
	fs.StringVar(&f.NATSNKey, "nats-nkey", os.Getenv("NATS_NKEY"),
		"file holding this service's nkey seed, used with --nats-url (deploy/nats; env NATS_NKEY)")
	fs.StringVar(&f.NATSCA, "nats-ca", os.Getenv("NATS_CA"),
		"PEM bundle of the CAs that sign the NATS server's certificate; requires TLS (env NATS_CA)")
	fs.StringVar(&f.NATSCert, "nats-cert", os.Getenv("NATS_CERT"),
		"client certificate for mutual TLS, with --nats-key (env NATS_CERT)")
	fs.StringVar(&f.NATSKey, "nats-key", os.Getenv("NATS_KEY"),
		"private key of --nats-cert (env NATS_KEY)")
	fs.StringVar(&f.NATSInbox, "nats-inbox-prefix", os.Getenv("NATS_INBOX_PREFIX"),
		"prefix of this connection's reply subjects instead of _INBOX; deploy/nats gives each identity its own, _INBOX_<identity> (env NATS_INBOX_PREFIX)")
	fs.IntVar(&f.Replicas, "replicas", 0,
		"stream and bucket replicas; 0 means 3 on a NATS cluster and 1 on a single or embedded server")
	fs.StringVar(&f.LogLevel, "log-level", envOr("PROXYFLEET_LOG_LEVEL", "info"),
		"log level: debug, info, warn or error (env PROXYFLEET_LOG_LEVEL)")
	fs.StringVar(&f.MetricsAddr, "metrics-addr", "",
		"serve Prometheus metrics at http://<addr>/metrics (e.g. 127.0.0.1:9464); empty disables")
	fs.StringVar(&f.CPUProfile, "cpuprofile", "",
		"write a CPU profile of this process (runtime/pprof; read it with go tool pprof) to this file, from the end of start-up until the process stops; empty: none (docs/performance.md)")
	registerVersion(fs, service)
	fs.BoolVar(&f.EnsureTopology, "ensure-topology", true,
		"create or update the streams, buckets and this service's durable consumers at start; false binds the existing ones, created beforehand by `planner bootstrap` (deploy/nats)")
}

// needServer returns an error naming the flags to set when the service
// would start without a NATS server: no URL, no context, and no embedding.
func (f *Flags) needServer(service string) error {
	if f.Embed != nil || f.NATSURL != "" || f.NATSContext != "" {
		return nil
	}
	return fmt.Errorf("--nats-url or --nats-context is required (env NATS_URL, NATS_CONTEXT): %s does not embed a NATS server; the planner does", service)
}

// embedNeedsAuth refuses, before anything starts, an embedded server that
// would listen beyond loopback with no configuration to authenticate from.
func (f *Flags) embedNeedsAuth() error {
	if f.Embed == nil || f.NATSURL != "" || f.NATSContext != "" || f.NATSServerConfig != "" || f.Listen == "" {
		return nil
	}
	if loopback, err := bus.ListenIsLoopback(f.Listen); err == nil && !loopback {
		return bus.NeedsAuthError(f.Listen)
	}
	return nil
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

// Base is what [Start] built. Close releases it in reverse order.
type Base struct {
	Name string
	Log  *slog.Logger
	Tel  *telemetry.Telemetry
	Conn *bus.Conn
	// profile is the --cpuprofile file being written, nil without one.
	profile *os.File
}

// Start builds the logger, telemetry and NATS connection for service name,
// and creates or updates the stream topology.
func Start(ctx context.Context, name string, f Flags) (*Base, error) {
	if err := f.needServer(name); err != nil {
		return nil, err
	}
	if err := f.embedNeedsAuth(); err != nil {
		return nil, err
	}
	level, err := telemetry.ParseLevel(f.LogLevel)
	if err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", f.LogLevel)
	}
	log := telemetry.NewLogger(os.Stderr, level, name)
	tel, err := telemetry.Setup(ctx, telemetry.Config{Service: name, MetricsAddr: f.MetricsAddr, Log: log})
	if err != nil {
		return nil, fmt.Errorf("telemetry: %w", err)
	}
	if tel.MetricsAddr != "" {
		// The bound address: with port 0 the kernel chose it.
		log.Info("metrics endpoint serving", "addr", tel.MetricsAddr)
	}
	cfg := bus.Config{
		URL:         f.NATSURL,
		Context:     f.NATSContext,
		CredsFile:   f.NATSCreds,
		NKeyFile:    f.NATSNKey,
		CAFile:      f.NATSCA,
		CertFile:    f.NATSCert,
		KeyFile:     f.NATSKey,
		NoCreate:    !f.EnsureTopology,
		InboxPrefix: f.NATSInbox,
		Name:        "proxyfleet-" + name,
		DataDir:     f.DataDir + "/jetstream",
		Listen:      f.Listen,
		Replicas:    f.Replicas,
		Embed:       f.Embed,
		// <data-dir>/<program>_<pid>.ports names the embedded server's
		// client URL, also when --nats-listen asked for port 0.
		PortsFileDir: f.DataDir,
	}
	cfg.ServerConfig = f.NATSServerConfig
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	conn, err := bus.Connect(cctx, cfg, log)
	if err != nil {
		_ = tel.Close(context.Background())
		return nil, err
	}
	if f.EnsureTopology || conn.Server != nil {
		if err := bus.EnsureTopology(cctx, conn); err != nil {
			conn.Close()
			_ = tel.Close(context.Background())
			return nil, fmt.Errorf("create streams and buckets: %w", err)
		}
	}
	if conn.Server != nil {
		log.Info("embedded NATS ready", "url", telemetry.RedactURL(conn.ClientURL()))
	}
	base := &Base{Name: name, Log: log, Tel: tel, Conn: conn}
	if f.CPUProfile != "" {
		if base.profile, err = startCPUProfile(f.CPUProfile); err != nil {
			base.Close()
			return nil, err
		}
		log.Info("writing a CPU profile until the service stops", "file", f.CPUProfile)
	}
	return base, nil
}

func startCPUProfile(path string) (*os.File, error) {
	out, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(out); err != nil {
		_ = out.Close()
		return nil, fmt.Errorf("--cpuprofile %s: %w", path, err)
	}
	return out, nil
}

// Close ends the CPU profile (--cpuprofile), flushes telemetry and closes
// NATS (stopping an embedded server).
func (b *Base) Close() {
	if b.profile != nil {
		pprof.StopCPUProfile()
		if err := b.profile.Close(); err != nil {
			b.Log.Error("--cpuprofile: the profile is incomplete", "file", b.profile.Name(), "err", err)
		}
		b.profile = nil
	}
	b.Conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = b.Tel.Close(ctx)
}

// NewFlagSet returns the flag set of service name: parse errors are
// returned, and --help prints usage and then every flag.
func NewFlagSet(name, usage string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usage)
		fs.PrintDefaults()
	}
	return fs
}

// ParseFlags parses args into fs and refuses positional arguments. After
// --help its error is [flag.ErrHelp].
func ParseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	return nil
}

// Main is the func main of a service whose command line parse reads: it
// returns the exit status, 0 after --help or a clean stop, 2 when parse
// fails and 1 when run does, the error on stderr as "<name>: <err>".
func Main[F any](name string, args []string, stderr io.Writer, parse func(args []string) (F, error), run func(F) error) int {
	f, err := parse(args)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return 2
	}
	if err := run(f); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", name, err)
		return 1
	}
	return 0
}

// ParseArgs parses a service's command line into fs, which must use
// flag.ContinueOnError. It accepts no positional arguments. When ok is
// false the caller exits with code: 0 after --help, 2 for a bad flag or an
// unexpected argument (already reported on stderr).
func ParseArgs(fs *flag.FlagSet, args []string, stderr io.Writer) (code int, ok bool) {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0, false
		}
		return 2, false
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "%s: unexpected argument %q (see --help)\n", fs.Name(), fs.Arg(0))
		return 2, false
	}
	return 0, true
}
