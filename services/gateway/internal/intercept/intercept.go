// Package intercept holds the certificates of the gateway's HTTPS
// interception: the fleet's gateway CA (a self-signed ECDSA P-256
// certificate clients of intercepting pools trust) and the short-lived
// leaf certificates it signs for each host a client connects to, kept in
// a bounded cache and issued once per host at a time.
//
// Where the CA is kept (the fleet-gateway-ca bucket) is package fleet's
// business; this package only makes, parses and signs.
package intercept

import (
	"container/list"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"strings"
	"sync"
	"time"
)

// Lifetimes and bounds of the certificates.
const (
	// CALifetime is how long a new gateway CA is valid.
	CALifetime = 10 * 365 * 24 * time.Hour
	// CACommonName is the CommonName of the gateway CA.
	CACommonName = "proxyfleet gateway CA"
	// LeafLifetime is how long a leaf certificate is valid.
	LeafLifetime = 7 * 24 * time.Hour
	// LeafRenewBefore is how long before its expiry a cached leaf is
	// replaced by a new one.
	LeafRenewBefore = 24 * time.Hour
	// DefaultCacheSize is how many hosts' leaves an [Issuer] keeps.
	DefaultCacheSize = 10000
	// backdate covers clients whose clocks run a little behind.
	backdate = time.Hour
	// maxHost bounds a host name a leaf is made for (a DNS name's limit).
	maxHost = 253
)

// CA is a certificate authority: its certificate and private key.
type CA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

// NewKey returns a new CA private key, PKCS #8 DER-encoded: what the
// fleet seals for the gateways.
func NewKey() ([]byte, error) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate the CA key: %w", err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return nil, fmt.Errorf("encode the CA key: %w", err)
	}
	return der, nil
}

// parseKey decodes a PKCS #8 ECDSA P-256 key. Its errors never quote the
// key.
func parseKey(der []byte) (*ecdsa.PrivateKey, error) {
	k, err := x509.ParsePKCS8PrivateKey(der)
	if err != nil {
		return nil, errors.New("the CA key is not a PKCS #8 private key")
	}
	ek, ok := k.(*ecdsa.PrivateKey)
	if !ok || ek.Curve != elliptic.P256() {
		return nil, errors.New("the CA key is not an ECDSA P-256 key")
	}
	return ek, nil
}

// SelfSign returns the PEM of a new self-signed CA certificate for the
// key keyDER (from [NewKey]), valid from now for [CALifetime]. Any
// certificate SelfSign makes for one key is as good as another: each
// signs the same leaves.
func SelfSign(keyDER []byte, now time.Time) ([]byte, error) {
	key, err := parseKey(keyDER)
	if err != nil {
		return nil, err
	}
	serial, err := serialNumber()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: CACommonName, Organization: []string{"proxyfleet"}},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(CALifetime),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("sign the CA certificate: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), nil
}

// ParseCA returns the CA of certificate certPEM and key keyDER. It fails
// when the certificate is not a CA's or is not the key's.
func ParseCA(certPEM, keyDER []byte) (*CA, error) {
	key, err := parseKey(keyDER)
	if err != nil {
		return nil, err
	}
	block, _ := pem.Decode(certPEM)
	if block == nil || block.Type != "CERTIFICATE" {
		return nil, errors.New("the CA certificate is not a PEM CERTIFICATE block")
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("the CA certificate does not parse: %w", err)
	}
	if !cert.IsCA {
		return nil, errors.New("the CA certificate is not a CA's (basic constraints)")
	}
	pub, ok := cert.PublicKey.(*ecdsa.PublicKey)
	if !ok || !pub.Equal(&key.PublicKey) {
		return nil, errors.New("the CA certificate is not the CA key's: its public key differs")
	}
	return &CA{cert: cert, key: key, pem: pem.EncodeToMemory(block)}, nil
}

// PEM returns the CA certificate, PEM-encoded: what clients trust.
func (ca *CA) PEM() []byte { return append([]byte(nil), ca.pem...) }

// Certificate returns the parsed CA certificate.
func (ca *CA) Certificate() *x509.Certificate { return ca.cert }

func serialNumber() (*big.Int, error) {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("certificate serial number: %w", err)
	}
	return n.Add(n, big.NewInt(1)), nil
}

// Issuer signs leaf certificates with a CA and caches them per host: at
// most size hosts, the least recently used forgotten first; a leaf is
// reissued once it is within [LeafRenewBefore] of expiring. Callers asking
// for one host at once wait for a single issuance. Safe for concurrent
// use.
type Issuer struct {
	ca   *CA
	size int
	now  func() time.Time
	// key is the private key of every leaf this issuer signs: made once,
	// so a miss costs a signature, not a key generation too.
	key *ecdsa.PrivateKey

	mu       sync.Mutex
	lru      *list.List // of *entry, most recently used first
	entries  map[string]*list.Element
	inflight map[string]*issuance
	issued   int
}

type entry struct {
	host string
	cert *tls.Certificate
}

// issuance is one host's leaf being signed; done closes when cert or err
// is set.
type issuance struct {
	done chan struct{}
	cert *tls.Certificate
	err  error
}

// NewIssuer returns an issuer signing with ca that keeps up to size
// hosts' leaves (size <= 0: [DefaultCacheSize]); now is the clock (nil:
// time.Now).
func NewIssuer(ca *CA, size int, now func() time.Time) (*Issuer, error) {
	if size <= 0 {
		size = DefaultCacheSize
	}
	if now == nil {
		now = time.Now
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate the leaf key: %w", err)
	}
	return &Issuer{ca: ca, size: size, now: now, key: key, lru: list.New(),
		entries: map[string]*list.Element{}, inflight: map[string]*issuance{}}, nil
}

// CA returns the issuer's CA.
func (i *Issuer) CA() *CA { return i.ca }

// Len returns how many hosts' leaves are cached.
func (i *Issuer) Len() int {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.lru.Len()
}

// Issued returns how many leaves the issuer signed.
func (i *Issuer) Issued() int {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.issued
}

// NormalizeHost is the name a leaf is made and cached for: host without a
// port or IPv6 brackets, lower-cased, without a trailing dot.
func NormalizeHost(host string) string {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimSuffix(strings.TrimPrefix(host, "["), "]"), ".")
	return strings.ToLower(host)
}

// Certificate returns a leaf certificate for host (a DNS name or an IP,
// with or without a port), from the cache or newly signed.
func (i *Issuer) Certificate(host string) (*tls.Certificate, error) {
	host = NormalizeHost(host)
	if host == "" || len(host) > maxHost {
		return nil, fmt.Errorf("no certificate for host %q: want a DNS name or an IP address", host)
	}
	i.mu.Lock()
	if el, ok := i.entries[host]; ok {
		e := el.Value.(*entry)
		if i.now().Before(e.cert.Leaf.NotAfter.Add(-LeafRenewBefore)) {
			i.lru.MoveToFront(el)
			i.mu.Unlock()
			return e.cert, nil
		}
	}
	if c, ok := i.inflight[host]; ok {
		i.mu.Unlock()
		<-c.done
		return c.cert, c.err
	}
	c := &issuance{done: make(chan struct{})}
	i.inflight[host] = c
	i.mu.Unlock()

	c.cert, c.err = i.sign(host)

	i.mu.Lock()
	delete(i.inflight, host)
	if c.err == nil {
		i.issued++
		i.store(host, c.cert)
	}
	i.mu.Unlock()
	close(c.done)
	return c.cert, c.err
}

// store caches cert for host, forgetting the least recently used host
// past the bound. i.mu is held.
func (i *Issuer) store(host string, cert *tls.Certificate) {
	if el, ok := i.entries[host]; ok {
		el.Value.(*entry).cert = cert
		i.lru.MoveToFront(el)
		return
	}
	i.entries[host] = i.lru.PushFront(&entry{host: host, cert: cert})
	for i.lru.Len() > i.size {
		last := i.lru.Back()
		i.lru.Remove(last)
		delete(i.entries, last.Value.(*entry).host)
	}
}

// sign makes a leaf for host, valid for [LeafLifetime] but never past the
// CA's own expiry.
func (i *Issuer) sign(host string) (*tls.Certificate, error) {
	serial, err := serialNumber()
	if err != nil {
		return nil, err
	}
	now := i.now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: host},
		NotBefore:    now.Add(-backdate),
		NotAfter:     now.Add(LeafLifetime),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	if tmpl.NotAfter.After(i.ca.cert.NotAfter) {
		tmpl.NotAfter = i.ca.cert.NotAfter
	}
	if ip := net.ParseIP(host); ip != nil {
		tmpl.IPAddresses = []net.IP{ip}
	} else {
		tmpl.DNSNames = []string{host}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, i.ca.cert, &i.key.PublicKey, i.ca.key)
	if err != nil {
		return nil, fmt.Errorf("sign a certificate for %q: %w", host, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse the certificate for %q: %w", host, err)
	}
	return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: i.key, Leaf: leaf}, nil
}
