package intercept

import (
	"crypto/x509"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func newCA(t *testing.T, now time.Time) *CA {
	t.Helper()
	key, err := NewKey()
	if err != nil {
		t.Fatal(err)
	}
	certPEM, err := SelfSign(key, now)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := ParseCA(certPEM, key)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

func roots(ca *CA) *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Certificate())
	return p
}

func TestCAIsASelfSignedP256CA(t *testing.T) {
	now := time.Now()
	ca := newCA(t, now)
	c := ca.Certificate()
	if !c.IsCA || c.Subject.CommonName != CACommonName || c.PublicKeyAlgorithm != x509.ECDSA {
		t.Errorf("CA certificate: IsCA %v, CN %q, key %v; want a CA, %q, ECDSA", c.IsCA, c.Subject.CommonName, c.PublicKeyAlgorithm, CACommonName)
	}
	if got := c.NotAfter.Sub(now); got < CALifetime-time.Minute || got > CALifetime+time.Minute {
		t.Errorf("CA lifetime %s; want %s", got, CALifetime)
	}
	if _, err := c.Verify(x509.VerifyOptions{Roots: roots(ca)}); err != nil {
		t.Errorf("the CA does not verify against itself: %v", err)
	}
	if !strings.HasPrefix(string(ca.PEM()), "-----BEGIN CERTIFICATE-----") {
		t.Errorf("PEM: %q", ca.PEM())
	}
}

func TestParseCARefusesAMismatch(t *testing.T) {
	key1, _ := NewKey()
	key2, _ := NewKey()
	cert1, err := SelfSign(key1, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name       string
		cert, key  []byte
		wantSubstr string
	}{
		{"another key", cert1, key2, "not the CA key's"},
		{"not PEM", []byte("hello"), key1, "not a PEM CERTIFICATE"},
		{"not a key", cert1, []byte("secret-material"), "not a PKCS #8"},
	} {
		_, err := ParseCA(c.cert, c.key)
		if err == nil || !strings.Contains(err.Error(), c.wantSubstr) {
			t.Errorf("%s: %v; want an error saying %q", c.name, err, c.wantSubstr)
		}
		if err != nil && strings.Contains(err.Error(), "secret-material") {
			t.Errorf("%s: the error quotes the key: %v", c.name, err)
		}
	}
}

func TestLeafVerifiesForItsHost(t *testing.T) {
	ca := newCA(t, time.Now())
	iss, err := NewIssuer(ca, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ ask, verify string }{
		{"Example.COM.", "example.com"},
		{"shop.example.com:8443", "shop.example.com"},
		{"127.0.0.1", "127.0.0.1"},
		{"[::1]:443", "::1"},
	} {
		cert, err := iss.Certificate(c.ask)
		if err != nil {
			t.Fatalf("Certificate(%q): %v", c.ask, err)
		}
		leaf := cert.Leaf
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: c.verify, Roots: roots(ca), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			t.Errorf("leaf for %q does not verify for %q: %v", c.ask, c.verify, err)
		}
		if ip := net.ParseIP(c.verify); ip != nil {
			if len(leaf.IPAddresses) != 1 || !leaf.IPAddresses[0].Equal(ip) || len(leaf.DNSNames) != 0 {
				t.Errorf("leaf for IP %s: IP SANs %v, DNS SANs %v; want the IP only", c.verify, leaf.IPAddresses, leaf.DNSNames)
			}
		}
		if err := leaf.VerifyHostname("other.example"); err == nil {
			t.Errorf("leaf for %q verifies for other.example", c.ask)
		}
		if life := time.Until(leaf.NotAfter); life > LeafLifetime || life < LeafLifetime-time.Minute {
			t.Errorf("leaf lifetime %s; want %s", life, LeafLifetime)
		}
	}
	if _, err := iss.Certificate(""); err == nil {
		t.Errorf("a leaf for an empty host was issued")
	}
}

func TestCacheIsBoundedAndLRU(t *testing.T) {
	iss, err := NewIssuer(newCA(t, time.Now()), 3, nil)
	if err != nil {
		t.Fatal(err)
	}
	get := func(h string) {
		t.Helper()
		if _, err := iss.Certificate(h); err != nil {
			t.Fatal(err)
		}
	}
	get("a.test")
	get("b.test")
	get("c.test")
	get("a.test") // a is now the most recently used: d evicts b
	get("d.test")
	if iss.Len() != 3 || iss.Issued() != 4 {
		t.Fatalf("cache %d hosts after %d issuances; want 3 after 4", iss.Len(), iss.Issued())
	}
	get("a.test")
	get("c.test")
	if iss.Issued() != 4 {
		t.Errorf("a and c were issued again (%d issuances); they should be cached", iss.Issued())
	}
	get("b.test")
	if iss.Issued() != 5 || iss.Len() != 3 {
		t.Errorf("b: %d issuances, %d cached; want it issued again (it was evicted) and the cache still 3", iss.Issued(), iss.Len())
	}
	for i := range 50 {
		get(fmt.Sprintf("h%d.test", i))
	}
	if iss.Len() != 3 {
		t.Errorf("cache holds %d hosts; bound 3", iss.Len())
	}
}

func TestLeafIsReissuedBeforeExpiry(t *testing.T) {
	var now atomic.Int64
	start := time.Now()
	now.Store(start.UnixNano())
	iss, err := NewIssuer(newCA(t, start), 0, func() time.Time { return time.Unix(0, now.Load()) })
	if err != nil {
		t.Fatal(err)
	}
	first, _ := iss.Certificate("a.test")
	now.Store(start.Add(LeafLifetime - LeafRenewBefore - time.Minute).UnixNano())
	if again, _ := iss.Certificate("a.test"); again != first {
		t.Errorf("a leaf with more than a day left was reissued")
	}
	now.Store(start.Add(LeafLifetime - LeafRenewBefore + time.Minute).UnixNano())
	renewed, _ := iss.Certificate("a.test")
	if renewed == first || !renewed.Leaf.NotAfter.After(first.Leaf.NotAfter) {
		t.Errorf("a leaf within a day of expiry was not reissued")
	}
	if iss.Len() != 1 {
		t.Errorf("cache holds %d entries for one host", iss.Len())
	}
}

func TestConcurrentCallersGetOneIssuance(t *testing.T) {
	iss, err := NewIssuer(newCA(t, time.Now()), 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	const callers = 64
	var wg sync.WaitGroup
	start := make(chan struct{})
	got := make([]any, callers)
	for n := range callers {
		wg.Go(func() {
			<-start
			c, err := iss.Certificate("same.test")
			if err != nil {
				t.Error(err)
			}
			got[n] = c
		})
	}
	close(start)
	wg.Wait()
	if iss.Issued() != 1 {
		t.Errorf("%d concurrent callers caused %d issuances; want 1", callers, iss.Issued())
	}
	for n := range got {
		if got[n] != got[0] {
			t.Fatalf("caller %d got another certificate than caller 0", n)
		}
	}
}
