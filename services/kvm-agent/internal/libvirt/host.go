package libvirt

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	golibvirt "github.com/digitalocean/go-libvirt"
	"github.com/digitalocean/go-libvirt/socket/dialers"

	"proxyfleet/pkg/agent"
)

// Options tune a [Host]. Zero values take the defaults noted.
type Options struct {
	// URI is the libvirt connection URI (default qemu:///system).
	URI string
	// RPCTimeout bounds one RPC, and one connection set-up (default 30s).
	RPCTimeout time.Duration
	// TransferTimeout bounds one volume upload (default 20m).
	TransferTimeout time.Duration
}

func (o *Options) defaults() {
	if o.URI == "" {
		o.URI = string(golibvirt.QEMUSystem)
	}
	if o.RPCTimeout <= 0 {
		o.RPCTimeout = 30 * time.Second
	}
	if o.TransferTimeout <= 0 {
		o.TransferTimeout = 20 * time.Minute
	}
}

// Host is one libvirt host. All work shares one connection, dialled lazily.
// Every RPC runs under its own budget; a call whose context ends or whose
// budget runs out kills the connection (go-libvirt calls cannot be
// cancelled otherwise) and the next call dials again. Calls made through
// [Host.Probe] abandon their RPC instead, leaving the connection to the
// work that shares it. Uploads use a connection of their own.
//
// Host is safe for concurrent use.
type Host struct {
	dialer Dialer
	opt    Options
	log    *slog.Logger

	// slot serialises dialling; waiting for it ends with the caller's ctx.
	slot chan struct{}
	mu   sync.Mutex // guards cur
	cur  *link
	// abandoned counts probe RPCs still waiting on libvirtd.
	abandoned atomic.Int32
}

// NewHost returns a host that dials with d. Nothing is dialled until the
// first call.
func NewHost(d Dialer, opt Options, log *slog.Logger) *Host {
	opt.defaults()
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Host{dialer: d, opt: opt, log: log, slot: make(chan struct{}, 1)}
}

// RPC returns the seam over the shared connection.
func (h *Host) RPC() RPC { return caller{h: h} }

// Probe returns the seam for health checks: a call whose context ends
// abandons its RPC and leaves the shared connection alone. While an
// abandoned RPC is still outstanding, further probe calls fail at once.
func (h *Host) Probe() RPC { return caller{h: h, abandon: true} }

// Close kills the shared connection.
func (h *Host) Close() {
	h.mu.Lock()
	l := h.cur
	h.cur = nil
	h.mu.Unlock()
	if l != nil {
		l.kill()
	}
}

// link is one go-libvirt connection.
type link struct {
	lv   *golibvirt.Libvirt
	conn net.Conn
	once sync.Once
}

// kill closes the connection under go-libvirt, failing its pending calls,
// and waits (bounded) for go-libvirt to notice.
func (l *link) kill() {
	l.once.Do(func() { _ = l.conn.Close() })
	select {
	case <-l.lv.Disconnected():
	case <-time.After(5 * time.Second):
	}
}

func (l *link) alive() bool { return l.lv.IsConnected() }

// open dials and connects a new link.
func (h *Host) open(ctx context.Context) (*link, error) {
	ctx, cancel := context.WithTimeout(ctx, h.opt.RPCTimeout)
	defer cancel()
	conn, err := h.dialer.Dial(ctx)
	if err != nil {
		return nil, Classify(fmt.Errorf("dial libvirt %s: %w", h.dialer, err))
	}
	l := &link{lv: golibvirt.NewWithDialer(dialers.NewAlreadyConnected(conn)), conn: conn}
	done := make(chan error, 1)
	go func() { done <- l.lv.ConnectToURI(golibvirt.ConnectURI(h.opt.URI)) }()
	select {
	case err := <-done:
		if err != nil {
			_ = conn.Close()
			return nil, Classify(fmt.Errorf("connect %s to %s: %w", h.dialer, h.opt.URI, fromLibvirt("virConnectOpen", err)))
		}
	case <-ctx.Done():
		_ = conn.Close()
		<-done
		return nil, agent.Wrap(agent.ErrTransient, fmt.Errorf("connect %s to %s: %w", h.dialer, h.opt.URI, ctx.Err()))
	}
	h.log.Debug("libvirt connected", "via", h.dialer.String())
	return l, nil
}

// shared returns the shared link, dialling it when there is none or it died.
func (h *Host) shared(ctx context.Context) (*link, error) {
	h.mu.Lock()
	l := h.cur
	h.mu.Unlock()
	if l != nil && l.alive() {
		return l, nil
	}
	select {
	case h.slot <- struct{}{}:
	case <-ctx.Done():
		return nil, agent.Wrap(agent.ErrTransient, fmt.Errorf("waiting for the libvirt connection to %s: %w", h.dialer, ctx.Err()))
	}
	defer func() { <-h.slot }()
	h.mu.Lock()
	l = h.cur
	h.mu.Unlock()
	if l != nil && l.alive() {
		return l, nil // another caller redialled while we waited
	}
	if l != nil {
		l.kill()
	}
	nl, err := h.open(ctx)
	if err != nil {
		return nil, err
	}
	h.mu.Lock()
	h.cur = nl
	h.mu.Unlock()
	return nl, nil
}

// drop kills l and forgets it if it is still the shared link.
func (h *Host) drop(l *link, why string) {
	h.mu.Lock()
	if h.cur == l {
		h.cur = nil
	}
	h.mu.Unlock()
	h.log.Warn("libvirt connection dropped", "via", h.dialer.String(), "reason", why)
	l.kill()
}

// result is what one RPC returned.
type result[T any] struct {
	v   T
	err error
}

// call runs fn (one RPC named rpc) on the shared link of h under the RPC
// budget. The result travels through a channel, so an abandoned RPC that
// returns late writes nothing the caller reads.
func call[T any](ctx context.Context, h *Host, rpc string, abandon bool, fn func(lv *golibvirt.Libvirt) (T, error)) (T, error) {
	var zero T
	if abandon && h.abandoned.Load() > 0 {
		return zero, agent.Wrap(agent.ErrTransient, fmt.Errorf("%s: an earlier check's call to libvirtd has not returned yet", rpc))
	}
	l, err := h.shared(ctx)
	if err != nil {
		return zero, err
	}
	cctx, cancel := context.WithTimeout(ctx, h.opt.RPCTimeout)
	defer cancel()
	done := make(chan result[T], 1)
	go func() {
		v, err := fn(l.lv)
		done <- result[T]{v, err}
	}()
	select {
	case r := <-done:
		err := r.err
		if err == nil {
			return r.v, nil
		}
		lerr := fromLibvirt(rpc, err)
		var le *Error
		if !errors.As(lerr, &le) {
			// No libvirt code: the connection itself failed.
			h.drop(l, rpc+": "+err.Error())
			return zero, agent.Wrap(agent.ErrTransient, fmt.Errorf("%s: libvirt connection failed: %w", rpc, err))
		}
		return zero, Classify(lerr)
	case <-cctx.Done():
		why := cctx.Err()
		if ctx.Err() == nil {
			why = fmt.Errorf("exceeded its %s budget", h.opt.RPCTimeout)
		}
		if abandon {
			h.abandoned.Add(1)
			go func() { <-done; h.abandoned.Add(-1) }()
		} else {
			h.drop(l, rpc+" cancelled")
		}
		return zero, agent.Wrap(agent.ErrTransient, fmt.Errorf("%s: %w", rpc, why))
	}
}

// uploadChunk is the largest stream packet payload sent. go-libvirt fills
// packets of up to 4 MiB; against libvirtd 9.0 that streamed at about a
// third of virsh vol-upload's rate, while 64 KiB packets beat it
// (make bench-kvm).
const uploadChunk = 64 << 10

// upload streams r into vol over a connection of its own, closed before
// upload returns, so libvirtd has let go of the stream when the caller
// decides what to do with the volume.
func (h *Host) upload(ctx context.Context, vol StorageVol, r io.Reader, length uint64) error {
	ctx, cancel := context.WithTimeout(ctx, h.opt.TransferTimeout)
	defer cancel()
	l, err := h.open(ctx)
	if err != nil {
		return err
	}
	defer l.kill()
	gate := &gateReader{r: r}
	defer gate.close()
	src := &eofReader{r: gate}
	cnt := &countingReader{r: src}
	done := make(chan error, 1)
	go func() { done <- l.lv.StorageVolUpload(vol, &chunkReader{r: cnt, size: uploadChunk}, 0, length, 0) }()
	select {
	case err = <-done:
	case <-ctx.Done():
		l.kill()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			h.log.Error("libvirt upload stream did not end after its connection was closed", "volume", vol.Name)
		}
		if serr := src.Err(); serr != nil {
			return agent.Wrap(agent.ErrTransient, fmt.Errorf("upload %s: source: %w", vol.Name, serr))
		}
		return agent.Wrap(agent.ErrTransient, fmt.Errorf("upload %s: %w", vol.Name, ctx.Err()))
	}
	if serr := src.Err(); serr != nil {
		return agent.Wrap(agent.ErrTransient, fmt.Errorf("upload %s: source failed after %d of %d bytes: %w", vol.Name, cnt.n.Load(), length, serr))
	}
	if err != nil {
		lerr := fromLibvirt("virStorageVolUpload", err)
		return Classify(fmt.Errorf("upload %s: %w", vol.Name, lerr))
	}
	if n := cnt.n.Load(); n != length {
		return agent.Wrap(agent.ErrTransient, fmt.Errorf("upload %s: source ended after %d of %d bytes", vol.Name, n, length))
	}
	return nil
}

// caller implements [RPC] on a [Host].
type caller struct {
	h       *Host
	abandon bool
}

var _ RPC = caller{}

func (c caller) do(ctx context.Context, rpc string, fn func(lv *golibvirt.Libvirt) error) error {
	_, err := call(ctx, c.h, rpc, c.abandon, func(lv *golibvirt.Libvirt) (struct{}, error) { return struct{}{}, fn(lv) })
	return err
}

func (c caller) ConnectGetLibVersion(ctx context.Context) (uint64, error) {
	return call(ctx, c.h, "virConnectGetLibVersion", c.abandon, func(lv *golibvirt.Libvirt) (uint64, error) { return lv.ConnectGetLibVersion() })
}

func (c caller) ConnectGetHostname(ctx context.Context) (string, error) {
	return call(ctx, c.h, "virConnectGetHostname", c.abandon, func(lv *golibvirt.Libvirt) (string, error) { return lv.ConnectGetHostname() })
}

func (c caller) ConnectListAllDomains(ctx context.Context) ([]Domain, error) {
	return call(ctx, c.h, "virConnectListAllDomains", c.abandon, func(lv *golibvirt.Libvirt) ([]Domain, error) {
		doms, _, err := lv.ConnectListAllDomains(1, 0)
		return doms, err
	})
}

func (c caller) StoragePoolLookupByName(ctx context.Context, name string) (StoragePool, error) {
	return call(ctx, c.h, "virStoragePoolLookupByName", c.abandon, func(lv *golibvirt.Libvirt) (StoragePool, error) { return lv.StoragePoolLookupByName(name) })
}

type poolInfo struct {
	state uint8
	avail uint64
}

func (c caller) StoragePoolGetInfo(ctx context.Context, pool StoragePool) (uint8, uint64, error) {
	pi, err := call(ctx, c.h, "virStoragePoolGetInfo", c.abandon, func(lv *golibvirt.Libvirt) (poolInfo, error) {
		state, _, _, avail, err := lv.StoragePoolGetInfo(pool)
		return poolInfo{state, avail}, err
	})
	return pi.state, pi.avail, err
}

func (c caller) StorageVolLookupByName(ctx context.Context, pool StoragePool, name string) (StorageVol, error) {
	return call(ctx, c.h, "virStorageVolLookupByName", c.abandon, func(lv *golibvirt.Libvirt) (StorageVol, error) { return lv.StorageVolLookupByName(pool, name) })
}

func (c caller) StorageVolCreateXML(ctx context.Context, pool StoragePool, xml string) (StorageVol, error) {
	return call(ctx, c.h, "virStorageVolCreateXML", c.abandon, func(lv *golibvirt.Libvirt) (StorageVol, error) { return lv.StorageVolCreateXML(pool, xml, 0) })
}

func (c caller) StorageVolGetPath(ctx context.Context, vol StorageVol) (string, error) {
	return call(ctx, c.h, "virStorageVolGetPath", c.abandon, func(lv *golibvirt.Libvirt) (string, error) { return lv.StorageVolGetPath(vol) })
}

func (c caller) StorageVolDelete(ctx context.Context, vol StorageVol) error {
	return c.do(ctx, "virStorageVolDelete", func(lv *golibvirt.Libvirt) error { return lv.StorageVolDelete(vol, 0) })
}

func (c caller) StorageVolUpload(ctx context.Context, vol StorageVol, r io.Reader, length uint64) error {
	return c.h.upload(ctx, vol, r, length)
}

func (c caller) StorageVolDownload(ctx context.Context, vol StorageVol, max uint64) ([]byte, error) {
	return call(ctx, c.h, "virStorageVolDownload", c.abandon, func(lv *golibvirt.Libvirt) ([]byte, error) {
		var buf bytes.Buffer
		err := lv.StorageVolDownload(vol, &buf, 0, max, 0)
		return buf.Bytes(), err
	})
}

func (c caller) DomainLookupByName(ctx context.Context, name string) (Domain, error) {
	return call(ctx, c.h, "virDomainLookupByName", c.abandon, func(lv *golibvirt.Libvirt) (Domain, error) { return lv.DomainLookupByName(name) })
}

func (c caller) DomainDefineXML(ctx context.Context, xml string) (Domain, error) {
	return call(ctx, c.h, "virDomainDefineXML", c.abandon, func(lv *golibvirt.Libvirt) (Domain, error) { return lv.DomainDefineXML(xml) })
}

func (c caller) DomainCreate(ctx context.Context, dom Domain) error {
	return c.do(ctx, "virDomainCreate", func(lv *golibvirt.Libvirt) error { return lv.DomainCreate(dom) })
}

func (c caller) DomainGetState(ctx context.Context, dom Domain) (int32, error) {
	return call(ctx, c.h, "virDomainGetState", c.abandon, func(lv *golibvirt.Libvirt) (int32, error) {
		st, _, err := lv.DomainGetState(dom, 0)
		return st, err
	})
}

func (c caller) DomainDestroy(ctx context.Context, dom Domain) error {
	return c.do(ctx, "virDomainDestroy", func(lv *golibvirt.Libvirt) error { return lv.DomainDestroy(dom) })
}

func (c caller) DomainUndefineFlags(ctx context.Context, dom Domain) error {
	return c.do(ctx, "virDomainUndefineFlags", func(lv *golibvirt.Libvirt) error {
		return lv.DomainUndefineFlags(dom, golibvirt.DomainUndefineNvram)
	})
}

func (c caller) DomainGetMetadata(ctx context.Context, dom Domain, uri string) (string, error) {
	return call(ctx, c.h, "virDomainGetMetadata", c.abandon, func(lv *golibvirt.Libvirt) (string, error) {
		return lv.DomainGetMetadata(dom, int32(golibvirt.DomainMetadataElement), golibvirt.OptString{uri}, golibvirt.DomainAffectCurrent)
	})
}

func (c caller) DomainInterfaceAddresses(ctx context.Context, dom Domain, source uint32) ([]DomainInterface, error) {
	return call(ctx, c.h, "virDomainInterfaceAddresses", c.abandon, func(lv *golibvirt.Libvirt) ([]DomainInterface, error) {
		return lv.DomainInterfaceAddresses(dom, source, 0)
	})
}
