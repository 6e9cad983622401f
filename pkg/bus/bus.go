// Package bus connects a service to NATS: it connects to the operator's
// cluster, or, in a service that can embed one (see [Config.Embed]), starts
// a JetStream server when no URL is given; it defines every
// stream, consumer and KV bucket in one place and creates or updates them
// idempotently; and it provides the event store that appends domain events
// with idempotency and optimistic-concurrency checks.
package bus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"proxyfleet/pkg/telemetry"
)

// DefaultListen is where an embedded server listens unless told otherwise.
const DefaultListen = "127.0.0.1:4222"

// Server is an embedded NATS server (a *server.Server of nats-server v2).
type Server interface {
	ClientURL() string
	Shutdown()
	WaitForShutdown()
}

// EmbedFunc starts the server [Connect] embeds, from cfg's DataDir, Listen
// and PortsFileDir. [proxyfleet/pkg/bus/embedded.Start] is the one there is;
// it lives in its own package so that programs which never embed do not
// link nats-server.
type EmbedFunc func(cfg Config, log *slog.Logger) (Server, error)

// ClientOptioner is an embedded [Server] whose embedding service connects
// with options of its own (in-process, with an identity the server accepts);
// [Connect] adds them.
type ClientOptioner interface {
	ClientOptions() []nats.Option
}

// ErrEmbedNeedsAuth is returned when an embedded server would listen on an
// address other than loopback without requiring authentication.
var ErrEmbedNeedsAuth = errors.New("the embedded NATS server needs authentication to listen beyond loopback")

// NeedsAuthError is the error, wrapping [ErrEmbedNeedsAuth], for an
// embedded server asked to listen on listen, not loopback, with no server
// configuration: it says how to configure authentication.
func NeedsAuthError(listen string) error {
	return fmt.Errorf("%w: --nats-listen %s is not a loopback address; add --nats-server-config FILE, a nats-server configuration whose authorization or accounts define users or nkeys (such as deploy/nats/nats-server.conf), or listen on 127.0.0.1",
		ErrEmbedNeedsAuth, listen)
}

// ListenIsLoopback reports whether the listen address host:port only
// accepts connections from this machine: its host is "localhost" or a
// loopback IP. An empty address means [DefaultListen]. An empty host, an
// unspecified address (0.0.0.0, ::) and any other name are not loopback.
func ListenIsLoopback(listen string) (bool, error) {
	if listen == "" {
		listen = DefaultListen
	}
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return false, fmt.Errorf("listen address %q: %w", listen, err)
	}
	if host == "localhost" {
		return true, nil
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback(), nil
}

// ErrNoServer is returned by [Connect] when it is given neither a URL nor a
// context and cannot embed a server.
var ErrNoServer = errors.New("no NATS URL or context given, and this program does not embed a NATS server")

// Config says how to reach NATS.
type Config struct {
	// URL of the operator's NATS servers. Empty (and no Context) means:
	// embed a server with Embed.
	URL string
	// Context names a nats CLI context (`nats context save`) giving the URL
	// and credentials; URL and CredsFile, when set, take precedence.
	Context string
	// CredsFile is a NATS credentials file used with URL.
	CredsFile string
	// NKeyFile is a file holding the user's nkey seed (deploy/nats names
	// users by their public nkeys); used with URL.
	NKeyFile string
	// CAFile is a PEM bundle of the CAs that sign the server's certificate.
	// Setting it requires TLS.
	CAFile string
	// CertFile and KeyFile are this client's certificate and key for mutual
	// TLS (both or neither).
	CertFile, KeyFile string
	// InboxPrefix replaces "_INBOX" as the prefix of this connection's reply
	// subjects. deploy/nats lets each identity subscribe only to its own
	// prefix (_INBOX_<identity>), so no identity can read the replies sent
	// to another: JetStream API answers, KV values, pulled commands.
	InboxPrefix string
	// NoCreate says this service may not create JetStream assets: durable
	// consumers are bound, never created or updated, and a missing one is an
	// error naming the bootstrap command (see [Conn.MayCreate]).
	NoCreate bool
	// User and Password authenticate with URL when set (deploy/nats uses
	// one user per service).
	User, Password string
	// Name is the client connection name, shown by `nats server report connections`.
	Name string

	// Embed starts a server when URL and Context are empty; nil means this
	// program does not embed, and Connect returns [ErrNoServer] instead.
	Embed EmbedFunc
	// DataDir is the embedded server's JetStream store directory.
	DataDir string
	// Listen is the embedded server's client address ("127.0.0.1:4222";
	// port -1 or 0 picks a free port). Empty means the listen address of
	// ServerConfig, else [DefaultListen].
	Listen string
	// ServerConfig is a nats-server configuration file for the embedded
	// server (authorization, accounts, TLS). A Listen that is not loopback
	// requires it to define users or nkeys ([ErrEmbedNeedsAuth]).
	ServerConfig string
	// PortsFileDir, when set, is where the embedded server writes its ports
	// file once it listens: <program>_<pid>.ports, JSON with the client URLs
	// ({"nats":["nats://127.0.0.1:4222"]}), removed at shutdown. It is how
	// a script learns the port the kernel chose for port 0.
	PortsFileDir string

	// Replicas for streams and buckets. 0 means 1 when embedded or connected
	// to a single server, and 3 when connected to a cluster.
	Replicas int
}

// Conn is a live NATS connection with JetStream, and the embedded server
// behind it when there is one.
type Conn struct {
	NC     *nats.Conn
	JS     jetstream.JetStream
	Server Server // nil when connected to an external server

	replicas int
	noCreate bool
	// idKey keys the Msg-Ids of the events this connection appends
	// (eventids.go); nil without authentication.
	idKey []byte
}

// MayCreate reports whether this connection creates and updates the
// durable consumers it uses. It is false for a service started with
// --ensure-topology=false on an external server: an administrator created
// them beforehand (`planner bootstrap`).
func (c *Conn) MayCreate() bool { return !c.noCreate }

// BootstrapHint is what to run when a stream, bucket or durable consumer a
// service only binds is missing.
const BootstrapHint = "create the topology first with the admin identity: planner bootstrap --nats-url URL --nats-nkey admin.nk --nats-ca ca.crt --agent ENTRY/TARGET ... (see docs/deploy.md)"

// Replicas is the replica count used for streams and buckets.
func (c *Conn) Replicas() int { return c.replicas }

// ClientURL is the URL other processes can use to reach this connection's
// server. Connected to an external server, it is the URL connected to, with
// any userinfo in it: log it through [telemetry.RedactURL].
func (c *Conn) ClientURL() string {
	if c.Server != nil {
		return c.Server.ClientURL()
	}
	return c.NC.ConnectedUrl()
}

// PingInterval and MaxPingsOut bound how long a connection stays with a
// server that no longer answers: about PingInterval × (MaxPingsOut+1).
const (
	PingInterval = 5 * time.Second
	MaxPingsOut  = 3
)

// Connect embeds or dials NATS according to cfg and waits until JetStream
// answers.
func Connect(ctx context.Context, cfg Config, log *slog.Logger) (*Conn, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	opts := []nats.Option{
		nats.Name(cfg.Name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		// A server that stops answering without closing the connection
		// (a frozen or partitioned node of a cluster) is given up after
		// MaxPingsOut unanswered pings, and the client moves to another
		// node; nats.go's defaults (2 minutes, 2 pings) would leave a
		// service frozen with it for up to four minutes.
		nats.PingInterval(PingInterval),
		nats.MaxPingsOutstanding(MaxPingsOut),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Info("nats reconnected", "url", telemetry.RedactURL(nc.ConnectedUrl()))
		}),
	}
	c := &Conn{replicas: cfg.Replicas}
	if cfg.InboxPrefix != "" {
		opts = append(opts, nats.CustomInboxPrefix(cfg.InboxPrefix))
	}
	if (cfg.CertFile == "") != (cfg.KeyFile == "") {
		return nil, errors.New("a client certificate needs both its certificate and its key file (--nats-cert and --nats-key)")
	}
	url := cfg.URL
	var secrets [][]byte
	if cfg.Context != "" {
		ctxURL, ctxOpts, ctxSecrets, err := contextOptions(cfg.Context)
		if err != nil {
			return nil, err
		}
		if url == "" {
			url = ctxURL
		}
		opts = append(opts, ctxOpts...)
		secrets = ctxSecrets
	}
	if url == "" {
		if cfg.Embed == nil {
			return nil, ErrNoServer
		}
		srv, err := cfg.Embed(cfg, log)
		if err != nil {
			return nil, err
		}
		c.Server = srv
		url = srv.ClientURL()
		if cfg.ServerConfig != "" {
			// A server that authenticates: its own client's nkey is
			// new at every start, so its Msg-Id key is kept on disk.
			if c.idKey, err = embeddedIDKey(cfg.DataDir); err != nil {
				c.shutdownServer()
				return nil, err
			}
		}
		if co, ok := srv.(ClientOptioner); ok {
			opts = append(opts, co.ClientOptions()...)
		}
		if c.replicas == 0 {
			c.replicas = 1
		}
	} else {
		if cfg.CredsFile != "" && cfg.NKeyFile != "" {
			return nil, errors.New("give either a credentials file (--nats-creds) or an nkey seed file (--nats-nkey), not both")
		}
		if cfg.CredsFile != "" {
			opts = append(opts, nats.UserCredentials(cfg.CredsFile))
			secrets = fileSecret(secrets, cfg.CredsFile)
		}
		if cfg.NKeyFile != "" {
			o, err := nats.NkeyOptionFromSeed(cfg.NKeyFile)
			if err != nil {
				return nil, fmt.Errorf("nkey seed file %s: %w", cfg.NKeyFile, err)
			}
			opts = append(opts, o)
			secrets = fileSecret(secrets, cfg.NKeyFile)
		}
		if cfg.CAFile != "" {
			opts = append(opts, nats.RootCAs(cfg.CAFile))
		}
		if cfg.CertFile != "" {
			opts = append(opts, nats.ClientCert(cfg.CertFile, cfg.KeyFile))
			secrets = fileSecret(secrets, cfg.KeyFile)
		}
		c.noCreate = cfg.NoCreate
		if cfg.User != "" {
			opts = append(opts, nats.UserInfo(cfg.User, cfg.Password))
			secrets = append(secrets, []byte(cfg.User+"\x00"+cfg.Password))
		}
		c.idKey = idKeyOf(secrets)
		if c.replicas == 0 {
			c.replicas = 3
		}
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		c.shutdownServer()
		return nil, fmt.Errorf("connect to NATS at %s: %w", telemetry.RedactURL(url), err)
	}
	c.NC = nc
	if c.Server == nil && cfg.Replicas == 0 && nc.ConnectedClusterName() == "" {
		// A single server, not a cluster, cannot hold replicated streams.
		c.replicas = 1
	}
	js, err := jetstream.New(nc)
	if err != nil {
		c.Close()
		return nil, err
	}
	c.JS = js
	if _, err := js.AccountInfo(ctx); err != nil {
		c.Close()
		return nil, fmt.Errorf("JetStream is not available at %s: %w", telemetry.RedactURL(url), err)
	}
	return c, nil
}

// Close drains the connection and stops the embedded server, if any.
func (c *Conn) Close() {
	if c.NC != nil {
		_ = c.NC.Drain()
		for i := 0; i < 50 && !c.NC.IsClosed(); i++ {
			time.Sleep(20 * time.Millisecond)
		}
		c.NC.Close()
	}
	c.shutdownServer()
}

func (c *Conn) shutdownServer() {
	if c.Server != nil {
		c.Server.Shutdown()
		c.Server.WaitForShutdown()
	}
}
