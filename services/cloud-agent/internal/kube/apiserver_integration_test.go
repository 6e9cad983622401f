//go:build integration

package kube

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/rest"

	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testnet"
	"proxyfleet/pkg/testwait"
)

// KubeVersion is the kube-apiserver the tier builds (services/cloud-agent/tools/kube).
const KubeVersion = "v1.34.2"

// cacheDir is where `make test-kube` keeps kube-apiserver and etcd, outside
// the checkout so every clone on a machine reuses them.
func cacheDir() string {
	if d := os.Getenv("XDG_CACHE_HOME"); d != "" {
		return filepath.Join(d, "proxyfleet")
	}
	home, _ := os.UserHomeDir()
	return filepath.Join(home, ".cache", "proxyfleet")
}

// controlPlane is one etcd and one kube-apiserver for the test binary.
type controlPlane struct {
	dir   string
	procs []*exec.Cmd
	admin *rest.Config
	err   error
}

var (
	cpOnce sync.Once
	cp     controlPlane
)

// TestMain stops the control plane after every test ran.
func TestMain(m *testing.M) {
	code := m.Run()
	cp.stop()
	os.Exit(code)
}

// adminConfig returns a client config with full rights on the shared
// control plane, starting it on first use. Missing binaries skip the test,
// or fail it under PROXYFLEET_REQUIRE_INTEGRATION=1.
func adminConfig(t *testing.T) *rest.Config {
	t.Helper()
	apiserver := envOr("KUBE_APISERVER", filepath.Join(cacheDir(), "kube-"+KubeVersion, "kube-apiserver"))
	etcd := envOr("ETCD", filepath.Join(cacheDir(), "etcd-root", "usr", "bin", "etcd"))
	testgate.NeedFile(t, apiserver, "kube-apiserver "+KubeVersion+"; `make test-kube` builds it")
	testgate.NeedFile(t, etcd, "etcd from Debian's etcd-server; `make test-kube` fetches it")
	cpOnce.Do(func() {
		cp.err = errors.New("control plane start aborted") // if start stops t
		cp.err = cp.start(t, apiserver, etcd)
	})
	if cp.err != nil {
		t.Fatalf("control plane: %v", cp.err)
	}
	return rest.CopyConfig(cp.admin)
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// start runs etcd and kube-apiserver without choosing a port for either
// by bind-then-close: etcd serves clients and peers on unix sockets in the
// control plane's directory, and kube-apiserver binds a port t holds for
// it with SO_REUSEPORT (--permit-port-sharing) until it listens.
func (c *controlPlane) start(t testing.TB, apiserver, etcd string) error {
	dir, err := os.MkdirTemp("", "proxyfleet-kube-")
	if err != nil {
		return err
	}
	c.dir = dir
	// etcd wants host:port even for a unix socket; the socket is the file
	// named by it, relative to etcd's working directory (c.dir).
	const etcdClient, etcdPeer = "unix://etcd-client:1", "unix://etcd-peer:1"
	if err := c.spawn("etcd", etcd,
		"--name=default", "--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-urls="+etcdClient, "--advertise-client-urls="+etcdClient,
		"--listen-peer-urls="+etcdPeer, "--initial-advertise-peer-urls="+etcdPeer,
		"--initial-cluster=default="+etcdPeer, "--unsafe-no-fsync=true", "--log-level=warn"); err != nil {
		return err
	}
	etcdSocket := filepath.Join(dir, "etcd-client:1")
	etcdHTTP := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", etcdSocket)
		},
	}}
	if err := poll(60*time.Second, func() error {
		resp, err := etcdHTTP.Get("http://etcd/health")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("etcd health %d", resp.StatusCode)
		}
		return nil
	}); err != nil {
		return fmt.Errorf("etcd never became healthy: %w\n%s", err, c.logTail("etcd"))
	}

	caPEM, certPEM, keyPEM, err := servingCert()
	if err != nil {
		return err
	}
	saKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	token := "admin-" + randHex(16)
	files := map[string][]byte{
		"serving.crt": certPEM, "serving.key": keyPEM,
		"sa.key":     pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(saKey)}),
		"tokens.csv": []byte(token + `,admin,admin-uid,"system:masters"` + "\n"),
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			return err
		}
	}
	port := testnet.Shared(t).Port
	if err := c.spawn("kube-apiserver", apiserver,
		"--etcd-servers=unix://"+etcdSocket,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", port),
		"--permit-port-sharing",
		"--tls-cert-file="+filepath.Join(dir, "serving.crt"), "--tls-private-key-file="+filepath.Join(dir, "serving.key"),
		"--cert-dir="+filepath.Join(dir, "certs"),
		"--token-auth-file="+filepath.Join(dir, "tokens.csv"),
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+filepath.Join(dir, "sa.key"),
		"--service-account-signing-key-file="+filepath.Join(dir, "sa.key"),
		"--service-cluster-ip-range=10.0.0.0/24",
		"--enable-priority-and-fairness=false",
		"--v=0"); err != nil {
		return err
	}
	c.admin = &rest.Config{
		Host:            fmt.Sprintf("https://127.0.0.1:%d", port),
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: caPEM},
		QPS:             100, Burst: 200,
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	if err := poll(180*time.Second, func() error {
		req, _ := http.NewRequest("GET", c.admin.Host+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := hc.Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("readyz %d", resp.StatusCode)
		}
		return nil
	}); err != nil {
		return fmt.Errorf("kube-apiserver never became ready: %w\n%s", err, c.logTail("kube-apiserver"))
	}
	return nil
}

func (c *controlPlane) spawn(name, bin string, args ...string) error {
	logf, err := os.Create(filepath.Join(c.dir, name+".log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Dir = c.dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", name, err)
	}
	c.procs = append(c.procs, cmd)
	return nil
}

func (c *controlPlane) logTail(name string) string {
	b, _ := os.ReadFile(filepath.Join(c.dir, name+".log"))
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return name + " log:\n" + string(b)
}

func (c *controlPlane) stop() {
	for i := len(c.procs) - 1; i >= 0; i-- {
		p := c.procs[i]
		testwait.Stop(p, syscall.SIGTERM, 10*time.Second)
	}
	if c.dir != "" {
		_ = os.RemoveAll(c.dir)
	}
}

func poll(timeout time.Duration, fn func() error) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var err error
	if testwait.For(ctx, func() bool { err = fn(); return err == nil }) != nil {
		return err
	}
	return nil
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%x", b)
}

// servingCert returns a throwaway CA and a serving certificate for
// 127.0.0.1 signed by it.
func servingCert() (caPEM, certPEM, keyPEM []byte, err error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "proxyfleet-test-ca"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, nil, nil, err
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "kube-apiserver"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, nil, nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, nil, err
	}
	var buf bytes.Buffer
	_ = pem.Encode(&buf, &pem.Block{Type: "CERTIFICATE", Bytes: caDER})
	caPEM = append([]byte(nil), buf.Bytes()...)
	return caPEM, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), nil
}
