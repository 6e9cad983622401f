// Package embedded runs the NATS server a proxyfleet service embeds when it
// is given no URL: nats-server v2 with JetStream, a file store and a client
// listener (loopback unless told otherwise). It is apart from package bus so
// that only the services that embed (the planner and health) link
// nats-server.
//
// A server listening on anything but loopback must require authentication:
// [bus.Config.ServerConfig] names a nats-server configuration file whose
// authorization or accounts define users or nkeys. The embedding service
// itself then connects in-process, as an nkey user made up at start whose
// seed exists only in its memory, so no secret of its own lies on disk.
package embedded

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"proxyfleet/pkg/bus"
)

var _ bus.EmbedFunc = Start

// Server is a running embedded nats-server and the options its embedding
// service connects with.
type Server struct {
	*server.Server
	clientOpts []nats.Option
}

var _ bus.ClientOptioner = (*Server)(nil)

// ClientOptions connect in-process when the server was configured from a
// file, authenticated as the embedding service's own nkey user when the file
// requires authentication; none otherwise (a plain TCP connection).
func (s *Server) ClientOptions() []nats.Option { return s.clientOpts }

// Start starts a JetStream-enabled nats-server that stores under
// cfg.DataDir. It listens on cfg.Listen, else on the listen address of
// cfg.ServerConfig, else on [bus.DefaultListen]. It is a [bus.EmbedFunc]: a
// service that embeds sets [bus.Config.Embed] to it.
//
// cfg.ServerConfig, when set, is a nats-server configuration file read by
// the server's own parser: its authorization, accounts, TLS, limits and
// monitoring apply, while JetStream always stores under cfg.DataDir. A
// listener that is not loopback needs that file to define users or nkeys;
// without them Start returns an error wrapping [bus.ErrEmbedNeedsAuth]
// before it creates or binds anything.
func Start(cfg bus.Config, log *slog.Logger) (bus.Server, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.DataDir == "" {
		return nil, errors.New("embedded NATS needs a data directory")
	}
	opts := &server.Options{}
	if cfg.ServerConfig != "" {
		o, err := server.ProcessConfigFile(cfg.ServerConfig)
		if err != nil {
			return nil, fmt.Errorf("NATS server configuration %s: %w", cfg.ServerConfig, err)
		}
		opts = o
	}
	listen := cfg.Listen
	if listen == "" && (opts.Host != "" || opts.Port != 0) {
		listen = net.JoinHostPort(opts.Host, strconv.Itoa(opts.Port))
	}
	if listen == "" {
		listen = bus.DefaultListen
	}
	host, portStr, err := net.SplitHostPort(listen)
	if err != nil {
		return nil, fmt.Errorf("listen address %q: %w", listen, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, fmt.Errorf("listen address %q: port must be a number", listen)
	}
	if port == 0 {
		port = server.RANDOM_PORT
	}
	auth, err := authentication(cfg.ServerConfig, opts)
	if err != nil {
		return nil, err
	}
	loopback, _ := bus.ListenIsLoopback(listen)
	if !loopback {
		switch {
		case cfg.ServerConfig == "":
			return nil, bus.NeedsAuthError(listen)
		case !auth:
			return nil, fmt.Errorf("%w: %s defines no users or nkeys (under authorization or accounts), so the embedded NATS server on %s would let anyone in; define them, or listen on 127.0.0.1",
				bus.ErrEmbedNeedsAuth, cfg.ServerConfig, listen)
		case opts.NoAuthUser != "":
			return nil, fmt.Errorf("%w: %s sets no_auth_user %s, which lets clients without credentials into the embedded NATS server on %s; remove it, or listen on 127.0.0.1",
				bus.ErrEmbedNeedsAuth, cfg.ServerConfig, opts.NoAuthUser, listen)
		}
	}
	var self nkeys.KeyPair
	if auth {
		if self, err = addSelf(cfg.ServerConfig, opts); err != nil {
			return nil, err
		}
	}

	if err := os.MkdirAll(cfg.DataDir, 0o750); err != nil {
		return nil, err
	}
	storeDir, err := filepath.Abs(cfg.DataDir)
	if err != nil {
		return nil, err
	}
	if opts.ServerName == "" {
		opts.ServerName = "proxyfleet-embedded"
	}
	opts.Host, opts.Port = host, port
	opts.JetStream, opts.StoreDir = true, storeDir
	opts.NoSigs, opts.NoLog = true, true
	if cfg.PortsFileDir != "" {
		opts.PortsFileDir = cfg.PortsFileDir
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("embedded NATS: %w", err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		return nil, fmt.Errorf("embedded NATS did not start listening on %s within 10s (is the port in use?)", listen)
	}
	s := &Server{Server: srv}
	if cfg.ServerConfig != "" {
		// In-process: no TLS to verify, and no reliance on reaching the
		// listener's address (0.0.0.0) from here.
		s.clientOpts = append(s.clientOpts, nats.InProcessServer(srv))
	}
	if self != nil {
		pub, _ := self.PublicKey()
		s.clientOpts = append(s.clientOpts, nats.Nkey(pub, self.Sign))
	}
	log.Info("embedded NATS started", "url", srv.ClientURL(), "store", storeDir, "auth", auth, "config", cfg.ServerConfig)
	return s, nil
}

// authentication reports whether opts (read from file) make clients
// authenticate with users or nkeys, the kinds the embedding service can add
// its own identity to. Other schemes are refused with a reason.
func authentication(file string, opts *server.Options) (bool, error) {
	switch {
	case len(opts.TrustedOperators) > 0 || opts.TrustedKeys != nil:
		return false, fmt.Errorf("%s: operator (JWT) mode is not supported by the embedded NATS server; run nats-server and give the services --nats-url", file)
	case opts.AuthCallout != nil:
		return false, fmt.Errorf("%s: auth_callout is not supported by the embedded NATS server; run nats-server and give the services --nats-url", file)
	case opts.Authorization != "" || opts.Username != "":
		return false, fmt.Errorf("%s: a single token or user under authorization is not supported by the embedded NATS server; define users (or nkeys) instead", file)
	}
	return len(opts.Users) > 0 || len(opts.Nkeys) > 0, nil
}

// addSelf adds the embedding service's own identity to opts: a fresh nkey
// user, unrestricted (it runs the server and reads its store anyway), in the
// one account the file defines besides the system account, or in the global
// account when it defines none. Its seed lives only in this process.
func addSelf(file string, opts *server.Options) (nkeys.KeyPair, error) {
	var accounts []*server.Account
	for _, a := range opts.Accounts {
		if a.GetName() != opts.SystemAccount && a.GetName() != server.DEFAULT_SYSTEM_ACCOUNT {
			accounts = append(accounts, a)
		}
	}
	if len(accounts) > 1 {
		names := make([]string, len(accounts))
		for i, a := range accounts {
			names[i] = a.GetName()
		}
		slices.Sort(names)
		return nil, fmt.Errorf("%s defines the accounts %s: the embedded NATS server keeps the fleet in one account besides the system account; define one, or run nats-server and give the services --nats-url",
			file, strings.Join(names, ", "))
	}
	kp, err := nkeys.CreateUser()
	if err != nil {
		return nil, fmt.Errorf("embedded NATS: create the service's own nkey: %w", err)
	}
	pub, err := kp.PublicKey()
	if err != nil {
		return nil, err
	}
	// In-process only: even a leaked seed opens no TCP connection.
	u := &server.NkeyUser{Nkey: pub, AllowedConnectionTypes: map[string]struct{}{jwt.ConnectionTypeInProcess: {}}}
	if len(accounts) == 1 {
		u.Account = accounts[0]
	}
	opts.Nkeys = append(opts.Nkeys, u)
	return kp, nil
}
