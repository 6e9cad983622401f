// Package image keeps base images in a libvirt storage pool: one base volume
// per provider entry and image key, "base-<entry>-<key>.<format>", filled by
// streaming the download into StorageVolUpload through a sha256 tee, and a
// marker volume "<base>.sha256" holding the digest, written only after the
// upload was complete and verified. A base without its marker is debris
// from an interrupted fetch and is replaced. A verified base is never
// replaced: overlays of running guests depend on it, so a changed digest is
// a permanent error asking the operator for a new image key.
package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/kvm-agent/internal/libvirt"
)

// Source is one configured image.
type Source struct {
	Key    string
	URL    string
	SHA256 string // optional, lowercase hex
	Format string // qcow2 or raw
}

// Base is a verified base volume.
type Base struct {
	Volume libvirt.StorageVol
	Path   string
	Format string
	SHA256 string
}

// Progress reports a running download.
type Progress struct {
	Image string `json:"image"`
	Done  uint64 `json:"done"`
	Total uint64 `json:"total"`
	// Finished is set on the last report of a fetch, with Err when it failed.
	Finished bool   `json:"finished,omitempty"`
	Err      string `json:"error,omitempty"`
}

// Config of a [Cache].
type Config struct {
	Entry string
	Pool  string
	// TransferTimeout bounds one fetch; the download's own deadline is one
	// minute inside it, so a stalled source ends through its reader first.
	TransferTimeout time.Duration
	HTTP            *http.Client
	// OnProgress, when set, receives progress at most every ProgressEvery.
	OnProgress    func(ctx context.Context, p Progress)
	ProgressEvery time.Duration
}

// Cache fetches and finds base volumes. Concurrent requests for one key
// share one fetch.
type Cache struct {
	rpc libvirt.RPC
	cfg Config
	log *slog.Logger

	mu      sync.Mutex
	flights map[string]*flight
}

type flight struct {
	done chan struct{}
	base Base
	err  error
}

// New returns a cache over rpc.
func New(rpc libvirt.RPC, cfg Config, log *slog.Logger) *Cache {
	if cfg.TransferTimeout <= 0 {
		cfg.TransferTimeout = 20 * time.Minute
	}
	if cfg.HTTP == nil {
		cfg.HTTP = &http.Client{}
	}
	if cfg.ProgressEvery <= 0 {
		cfg.ProgressEvery = time.Second
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Cache{rpc: rpc, cfg: cfg, log: log, flights: map[string]*flight{}}
}

// VolumeName is the base volume of key: "base-<entry>-<key>.<format>". The
// entry is part of it so two entries on one host never share a file.
func VolumeName(entry, key, format string) string {
	return "base-" + entry + "-" + key + "." + format
}

// MarkerName is the marker volume of a base volume.
func MarkerName(base string) string { return base + ".sha256" }

var hex64 = regexp.MustCompile(`^[0-9a-f]{64}$`)

// Ensure returns the verified base of src, fetching it when needed. A fetch
// continues when ctx ends (up to the transfer budget), so a retry finds it
// done or joins it.
func (c *Cache) Ensure(ctx context.Context, src Source) (Base, error) {
	c.mu.Lock()
	f := c.flights[src.Key]
	if f == nil {
		f = &flight{done: make(chan struct{})}
		c.flights[src.Key] = f
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.TransferTimeout)
		go func() {
			defer cancel()
			f.base, f.err = c.ensure(fctx, src)
			c.mu.Lock()
			delete(c.flights, src.Key)
			c.mu.Unlock()
			close(f.done)
		}()
	}
	c.mu.Unlock()
	select {
	case <-f.done:
		return f.base, f.err
	case <-ctx.Done():
		return Base{}, agent.Wrap(agent.ErrTransient, fmt.Errorf("image %s: still fetching: %w", src.Key, ctx.Err()))
	}
}

// Wait blocks until no fetch is running (for shutdown and tests).
func (c *Cache) Wait() {
	for {
		c.mu.Lock()
		var f *flight
		for _, v := range c.flights {
			f = v
			break
		}
		c.mu.Unlock()
		if f == nil {
			return
		}
		<-f.done
	}
}

func (c *Cache) ensure(ctx context.Context, src Source) (Base, error) {
	pool, err := c.rpc.StoragePoolLookupByName(ctx, c.cfg.Pool)
	if err != nil {
		return Base{}, fmt.Errorf("image %s: storage pool %s: %w", src.Key, c.cfg.Pool, err)
	}
	name := VolumeName(c.cfg.Entry, src.Key, src.Format)
	log := c.log.With("image", src.Key, "volume", name)
	mvol, err := c.rpc.StorageVolLookupByName(ctx, pool, MarkerName(name))
	switch {
	case err == nil:
		raw, err := c.rpc.StorageVolDownload(ctx, mvol, 64)
		if err != nil {
			return Base{}, fmt.Errorf("image %s: read marker: %w", src.Key, err)
		}
		digest := strings.TrimSpace(string(raw))
		if !hex64.MatchString(digest) {
			log.Warn("image marker is not a digest; replacing the base")
			if err := c.remove(ctx, pool, MarkerName(name)); err != nil {
				return Base{}, err
			}
			break
		}
		if src.SHA256 != "" && digest != src.SHA256 {
			return Base{}, agent.Wrap(agent.ErrPermanent, fmt.Errorf(
				"image %s: sha256 of the cached base %s is %s but images.%s.sha256 is %s; add a new image key instead of changing this one (a verified base is never replaced under running guests)",
				src.Key, name, digest, src.Key, src.SHA256))
		}
		vol, err := c.rpc.StorageVolLookupByName(ctx, pool, name)
		if err == nil {
			path, err := c.rpc.StorageVolGetPath(ctx, vol)
			if err != nil {
				return Base{}, err
			}
			return Base{Volume: vol, Path: path, Format: src.Format, SHA256: digest}, nil
		}
		if !libvirt.IsNotFound(err) {
			return Base{}, err
		}
		log.Warn("image marker without its base; fetching again")
		if err := c.remove(ctx, pool, MarkerName(name)); err != nil {
			return Base{}, err
		}
	case libvirt.IsNotFound(err):
	default:
		return Base{}, fmt.Errorf("image %s: look up marker: %w", src.Key, err)
	}
	return c.fetch(ctx, pool, name, src, log)
}

// remove deletes a volume by name; a missing one is fine.
func (c *Cache) remove(ctx context.Context, pool libvirt.StoragePool, name string) error {
	vol, err := c.rpc.StorageVolLookupByName(ctx, pool, name)
	if libvirt.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if err := c.rpc.StorageVolDelete(ctx, vol); err != nil && !libvirt.IsNotFound(err) {
		return err
	}
	return nil
}

func (c *Cache) fetch(ctx context.Context, pool libvirt.StoragePool, name string, src Source, log *slog.Logger) (Base, error) {
	// No marker: whatever base exists is debris of an unverified fetch.
	if err := c.remove(ctx, pool, name); err != nil {
		return Base{}, err
	}
	dctx, cancel := context.WithTimeout(ctx, c.cfg.TransferTimeout-time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(dctx, http.MethodGet, src.URL, nil)
	if err != nil {
		return Base{}, agent.Wrap(agent.ErrPermanent, fmt.Errorf("image %s: %w", src.Key, err))
	}
	resp, err := c.cfg.HTTP.Do(req)
	if err != nil {
		return Base{}, agent.Wrap(agent.ErrTransient, fmt.Errorf("image %s: download: %w", src.Key, err))
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		class := agent.ErrTransient
		if resp.StatusCode >= 400 && resp.StatusCode < 500 && resp.StatusCode != http.StatusRequestTimeout && resp.StatusCode != http.StatusTooManyRequests {
			class = agent.ErrPermanent
		}
		return Base{}, agent.Wrap(class, fmt.Errorf("image %s: download %s: %s", src.Key, src.URL, resp.Status))
	}
	if resp.ContentLength <= 0 {
		return Base{}, agent.Wrap(agent.ErrPermanent, fmt.Errorf("image %s: %s sent no Content-Length; the upload into libvirt needs the size up front", src.Key, src.URL))
	}
	total := uint64(resp.ContentLength)
	log.Info("fetching image", "bytes", total)
	vol, err := c.rpc.StorageVolCreateXML(ctx, pool, rawVolumeXML(name, total))
	if err != nil {
		return Base{}, fmt.Errorf("image %s: create volume: %w", src.Key, err)
	}
	h := sha256.New()
	pr := &progressReader{r: io.TeeReader(resp.Body, h), c: c, ctx: ctx, p: Progress{Image: src.Key, Total: total}}
	err = c.rpc.StorageVolUpload(ctx, vol, pr, total)
	_ = resp.Body.Close()
	if err != nil {
		// The upload's own connection is closed by now, so libvirtd has let
		// go of the stream before the partial file is unlinked.
		c.discard(ctx, vol, log)
		pr.finish(err)
		return Base{}, fmt.Errorf("image %s: %w", src.Key, err)
	}
	sum := hex.EncodeToString(h.Sum(nil))
	if src.SHA256 != "" && sum != src.SHA256 {
		c.discard(ctx, vol, log)
		err := agent.Wrap(agent.ErrPermanent, fmt.Errorf("image %s: downloaded sha256 %s differs from images.%s.sha256 %s", src.Key, sum, src.Key, src.SHA256))
		pr.finish(err)
		return Base{}, err
	}
	mvol, err := c.rpc.StorageVolCreateXML(ctx, pool, rawVolumeXML(MarkerName(name), uint64(len(sum))))
	if err == nil {
		err = c.rpc.StorageVolUpload(ctx, mvol, strings.NewReader(sum), uint64(len(sum)))
		if err != nil {
			c.discard(ctx, mvol, log)
		}
	}
	if err != nil {
		pr.finish(err)
		return Base{}, fmt.Errorf("image %s: write marker: %w", src.Key, err)
	}
	path, err := c.rpc.StorageVolGetPath(ctx, vol)
	if err != nil {
		return Base{}, err
	}
	pr.finish(nil)
	log.Info("image cached", "sha256", sum)
	return Base{Volume: vol, Path: path, Format: src.Format, SHA256: sum}, nil
}

// discard deletes a partial volume, even when ctx has ended.
func (c *Cache) discard(ctx context.Context, vol libvirt.StorageVol, log *slog.Logger) {
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if err := c.rpc.StorageVolDelete(dctx, vol); err != nil && !libvirt.IsNotFound(err) {
		log.Error("could not discard partial volume; it is replaced on the next fetch", "partial", vol.Name, "err", err)
	}
}

func rawVolumeXML(name string, size uint64) string {
	return fmt.Sprintf("<volume>\n  <name>%s</name>\n  <capacity unit='bytes'>%d</capacity>\n  <allocation unit='bytes'>0</allocation>\n  <target>\n    <format type='raw'/>\n  </target>\n</volume>\n", name, size)
}

// progressReader reports bytes read through it. After a failed upload a
// read may still be in flight in go-libvirt's sender, hence the lock.
type progressReader struct {
	r    io.Reader
	c    *Cache
	ctx  context.Context
	mu   sync.Mutex
	p    Progress
	last time.Time
}

func (p *progressReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.p.Done += uint64(n)
	if p.c.cfg.OnProgress != nil && !p.p.Finished && time.Since(p.last) >= p.c.cfg.ProgressEvery {
		p.last = time.Now()
		p.c.cfg.OnProgress(p.ctx, p.p)
	}
	return n, err
}

func (p *progressReader) finish(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.c.cfg.OnProgress == nil {
		return
	}
	p.p.Finished = true
	if err != nil {
		p.p.Err = err.Error()
	}
	p.c.cfg.OnProgress(p.ctx, p.p)
}
