package kvm

import (
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"go.opentelemetry.io/otel/trace"

	"proxyfleet/pkg/events"
	"proxyfleet/services/kvm-agent/internal/config"
	"proxyfleet/services/kvm-agent/internal/image"
	"proxyfleet/services/kvm-agent/internal/libvirt"
)

// Options are the parts of [Open] that do not come from the config file.
type Options struct {
	Log    *slog.Logger
	Tracer trace.Tracer
	// Publish sends core-NATS messages (download progress); nil drops them.
	Publish func(subject string, data []byte) error
	// VerboseRPC logs domain and volume XML with each libvirt call.
	VerboseRPC bool
	// HTTP downloads images (default: a client with sane dial timeouts).
	HTTP *http.Client
	// ProgressEvery is the interval of progress messages (default 1s).
	ProgressEvery time.Duration
	// Dialer replaces the dialer the config describes (tests wrap it to
	// break connections).
	Dialer func(configured libvirt.Dialer) libvirt.Dialer
}

// Stack is a driver with what it was built on.
type Stack struct {
	Driver *Driver
	Host   *libvirt.Host
	Images *image.Cache
}

// Close drops the libvirt connection. Image fetches still running end with
// their transfer budget (or the process).
func (s *Stack) Close() { s.Host.Close() }

// Open builds the driver for cfg: the host connection (local socket or
// SSH), the traced seam, the image cache publishing progress, the driver.
// Nothing is dialled until the first call.
func Open(cfg *config.Config, o Options) *Stack {
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var d libvirt.Dialer = libvirt.LocalDialer{Socket: cfg.Libvirt.Socket}
	if s := cfg.Libvirt.SSH; s != nil {
		addr := s.Host
		if _, _, err := net.SplitHostPort(addr); err != nil {
			addr = net.JoinHostPort(addr, "22")
		}
		d = libvirt.SSHDialer{Addr: addr, User: s.User, KeyFile: s.KeyFile, KnownHostsFile: s.KnownHostsFile, Socket: s.Socket}
		// Read again on every dial; say now if they are not there yet.
		for _, f := range []string{s.KeyFile, s.KnownHostsFile} {
			if _, err := os.Stat(f); err != nil {
				log.Warn("ssh file not readable yet; connections fail until it is", "file", f, "err", err)
			}
		}
	}
	if o.Dialer != nil {
		d = o.Dialer(d)
	}
	transfer := time.Duration(cfg.Libvirt.TransferTimeout)
	host := libvirt.NewHost(d, libvirt.Options{URI: cfg.Libvirt.URI, RPCTimeout: time.Duration(cfg.Libvirt.RPCTimeout), TransferTimeout: transfer}, log.With("component", "libvirt"))
	rpcLog := log.With("component", "libvirt")
	rpc := libvirt.Traced(host.RPC(), rpcLog, o.Tracer, o.VerboseRPC)
	probe := libvirt.Traced(host.Probe(), rpcLog, o.Tracer, o.VerboseRPC)
	httpc := o.HTTP
	if httpc == nil {
		httpc = &http.Client{Transport: &http.Transport{
			Proxy:                 http.ProxyFromEnvironment,
			DialContext:           (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			TLSHandshakeTimeout:   30 * time.Second,
			ResponseHeaderTimeout: time.Minute,
			IdleConnTimeout:       90 * time.Second,
		}}
	}
	subject := events.ProgressSubject(cfg.Entry, cfg.Target)
	images := image.New(rpc, image.Config{
		Entry: cfg.Entry, Pool: cfg.Pool, TransferTimeout: transfer, HTTP: httpc, ProgressEvery: o.ProgressEvery,
		OnProgress: func(_ context.Context, p image.Progress) {
			if o.Publish == nil {
				return
			}
			b, _ := json.Marshal(p)
			if err := o.Publish(subject, b); err != nil {
				log.Debug("progress not published", "err", err)
			}
		},
	}, log.With("component", "image"))
	return &Stack{Driver: New(cfg, rpc, probe, images, log.With("component", "kvm")), Host: host, Images: images}
}
