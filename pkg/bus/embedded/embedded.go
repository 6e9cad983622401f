// Package embedded runs the NATS server a proxyfleet service embeds when it
// is given no URL: nats-server v2 with JetStream, a file store and a
// loopback client listener. It is apart from package bus so that only the
// services that embed (the planner and health) link nats-server.
package embedded

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"proxyfleet/pkg/bus"
)

var _ bus.EmbedFunc = Start

// Start starts a JetStream-enabled nats-server that stores under
// cfg.DataDir and listens on cfg.Listen (default [bus.DefaultListen]). It
// is a [bus.EmbedFunc]: a service that embeds sets [bus.Config.Embed] to it.
func Start(cfg bus.Config, log *slog.Logger) (bus.Server, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.DataDir == "" {
		return nil, errors.New("embedded NATS needs a data directory")
	}
	listen := cfg.Listen
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
	if err := os.MkdirAll(cfg.DataDir, 0o750); err != nil {
		return nil, err
	}
	storeDir, err := filepath.Abs(cfg.DataDir)
	if err != nil {
		return nil, err
	}
	opts := &server.Options{
		ServerName: "proxyfleet-embedded",
		Host:       host,
		Port:       port,
		JetStream:  true,
		StoreDir:   storeDir,
		NoSigs:     true,
		NoLog:      true,

		PortsFileDir: cfg.PortsFileDir,
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
	log.Info("embedded NATS started", "url", srv.ClientURL(), "store", storeDir)
	return srv, nil
}
