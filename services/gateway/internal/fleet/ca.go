package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/seal"
	"proxyfleet/services/gateway/internal/intercept"
)

// The keys of the fleet-gateway-ca bucket.
const (
	// CACertKey holds the CA certificate, PEM: public.
	CACertKey = "cert"
	// CAKeyKey holds the CA's private key (PKCS #8) sealed to the
	// gateways' curve key, as JSON of events.Sealed.
	CAKeyKey = "key"
)

// caRetryMax bounds the wait between attempts at loading the CA.
const caRetryMax = 30 * time.Second

// errCALoading is why interception waits before the first attempt ends.
var errCALoading = errors.New("the gateway CA is not loaded yet; try again in a moment")

// gatewayCA is the fleet's gateway CA as this gateway holds it: the
// issuer of intercepted connections' certificates, or why there is none.
type gatewayCA struct {
	mu     sync.Mutex
	issuer *intercept.Issuer
	err    error
}

func (c *gatewayCA) get() (*intercept.Issuer, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.issuer == nil && c.err == nil {
		return nil, errCALoading
	}
	return c.issuer, c.err
}

func (c *gatewayCA) set(iss *intercept.Issuer, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.issuer, c.err = iss, err
}

// Issuer returns the issuer of the leaf certificates of intercepted
// connections, or why this gateway cannot intercept (the CA not loaded
// yet, or sealed to another key): forward.CA.
func (f *Fleet) Issuer() (*intercept.Issuer, error) { return f.ca.get() }

// CAPEM returns the gateway CA's certificate, PEM, or why it is not known.
func (f *Fleet) CAPEM() ([]byte, error) {
	iss, err := f.ca.get()
	if err != nil {
		return nil, err
	}
	return iss.CA().PEM(), nil
}

// runCA loads the fleet's gateway CA from fleet-gateway-ca, creating it
// when it is absent, and retries, waiting longer each time up to
// caRetryMax, until it is loaded or ctx ends. Until then intercepting
// pools are answered 503 with the reason; other pools are not affected.
func (f *Fleet) runCA(ctx context.Context) {
	delay := time.Second
	var last string
	for {
		iss, err := f.loadCA(ctx)
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			f.ca.set(iss, nil)
			f.log.Info("gateway CA loaded", "bucket", bus.BucketGatewayCA, "subject", iss.CA().Certificate().Subject.CommonName,
				"not_after", iss.CA().Certificate().NotAfter.UTC().Format(time.RFC3339), "ca_out", f.cfg.CAOut)
			if f.cfg.CAOut != "" {
				if err := writeFileAtomic(f.cfg.CAOut, iss.CA().PEM(), 0o644); err != nil {
					f.log.Error("write the gateway CA certificate to --ca-out", "path", f.cfg.CAOut, "err", err)
				}
			}
			return
		}
		f.ca.set(nil, err)
		if err.Error() != last {
			f.log.Error("the gateway CA does not load: pools with gateway.intercept are answered 503 until it does", "err", err, "retry_in", delay.String())
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, caRetryMax)
	}
}

func (f *Fleet) loadCA(ctx context.Context) (*intercept.Issuer, error) {
	kv, err := f.conn.JS.KeyValue(ctx, bus.BucketGatewayCA)
	if err != nil {
		return nil, fmt.Errorf("bucket %s: %w", bus.BucketGatewayCA, err)
	}
	ca, err := LoadOrCreateCA(ctx, kv, f.cfg.Key, time.Now())
	if err != nil {
		return nil, err
	}
	return intercept.NewIssuer(ca, intercept.DefaultCacheSize, nil)
}

// LoadOrCreateCA returns the CA kept in kv (the fleet-gateway-ca bucket),
// creating it when absent. Every step is create-if-absent, so gateways
// racing each other and a gateway repeating the steps after a crash end
// with the one CA:
//
//  1. key absent: make a CA key, seal it to key's public half and Create
//     it; a gateway that loses the Create reads the winner's;
//  2. open the sealed key (it fails when the gateways do not share one
//     --key-file);
//  3. cert absent (none yet, or its creator stopped after step 1): sign a
//     certificate with the key and Create it; the loser reads the
//     winner's. Any certificate of the key is as good as another.
//
// Its errors never quote the key.
func LoadOrCreateCA(ctx context.Context, kv jetstream.KeyValue, key nkeys.KeyPair, now time.Time) (*intercept.CA, error) {
	sealed, err := createOrGet(ctx, kv, CAKeyKey, func() ([]byte, error) {
		der, err := intercept.NewKey()
		if err != nil {
			return nil, err
		}
		box, err := seal.Seal(der, seal.Public(key))
		if err != nil {
			return nil, err
		}
		return json.Marshal(box)
	})
	if err != nil {
		return nil, err
	}
	var box events.Sealed
	if err := json.Unmarshal(sealed, &box); err != nil {
		return nil, fmt.Errorf("%s %s: the sealed CA key does not decode; delete both keys of the bucket (nats kv del %s %s; nats kv del %s %s) and restart the gateways to make a new CA",
			bus.BucketGatewayCA, CAKeyKey, bus.BucketGatewayCA, CAKeyKey, bus.BucketGatewayCA, CACertKey)
	}
	der, err := seal.Open(key, &box)
	if errors.Is(err, seal.ErrWrongKey) {
		return nil, fmt.Errorf("%s %s: the CA key is sealed to another gateway key (%w); give every gateway the same --key-file", bus.BucketGatewayCA, CAKeyKey, err)
	}
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", bus.BucketGatewayCA, CAKeyKey, err)
	}
	certPEM, err := createOrGet(ctx, kv, CACertKey, func() ([]byte, error) { return intercept.SelfSign(der, now) })
	if err != nil {
		return nil, err
	}
	ca, err := intercept.ParseCA(certPEM, der)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", bus.BucketGatewayCA, err)
	}
	return ca, nil
}

// createOrGet returns the value of key in kv, creating it with build's
// value when absent; a Create lost to another writer reads the winner's.
func createOrGet(ctx context.Context, kv jetstream.KeyValue, key string, build func() ([]byte, error)) ([]byte, error) {
	for attempt := 0; ; attempt++ {
		e, err := kv.Get(ctx, key)
		if err == nil {
			return e.Value(), nil
		}
		if !errors.Is(err, jetstream.ErrKeyNotFound) {
			return nil, fmt.Errorf("read %s %s: %w", bus.BucketGatewayCA, key, err)
		}
		if attempt > 0 {
			// Created by another, then deleted before it could be read.
			return nil, fmt.Errorf("read %s %s: it was deleted while the CA was being created; try again", bus.BucketGatewayCA, key)
		}
		v, err := build()
		if err != nil {
			return nil, err
		}
		if _, err := kv.Create(ctx, key, v); err == nil {
			return v, nil
		} else if !errors.Is(err, jetstream.ErrKeyExists) {
			return nil, fmt.Errorf("create %s %s: %w", bus.BucketGatewayCA, key, err)
		}
	}
}

// writeFileAtomic writes data to path with mode perm, replacing it whole:
// a reader never sees part of it.
func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".new-*")
	if err != nil {
		return err
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	_, werr := tmp.Write(data)
	if err := errors.Join(werr, tmp.Chmod(perm), tmp.Close()); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
