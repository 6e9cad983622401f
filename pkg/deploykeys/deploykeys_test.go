package deploykeys_test

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nats-io/nkeys"

	"proxyfleet/pkg/deploykeys"
)

func TestGenerate(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "secrets")
	pubs, err := deploykeys.Generate(deploykeys.Options{Dir: dir, Agents: []string{"local/t1", "kvm/host-2"}, Hosts: []string{"nats.test", "127.0.0.1"}})
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(dir); err != nil || st.Mode().Perm() != 0o700 {
		t.Fatalf("output directory: %v, mode %v", err, st.Mode())
	}
	env, err := os.ReadFile(filepath.Join(dir, deploykeys.EnvFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"admin", "planner", "health", "operator", "console", "backup", "agent-local-t1", "agent-kvm-host-2", "gateway-gw-1"} {
		b, err := os.ReadFile(filepath.Join(dir, id+".nk"))
		if err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		if st, _ := os.Stat(filepath.Join(dir, id+".nk")); st.Mode().Perm() != 0o600 {
			t.Errorf("%s.nk has mode %v, want 0600", id, st.Mode().Perm())
		}
		kp, err := nkeys.FromSeed([]byte(strings.TrimSpace(string(b))))
		if err != nil {
			t.Fatalf("%s.nk is not a seed: %v", id, err)
		}
		pub, _ := kp.PublicKey()
		if pub != pubs[id] || !strings.HasPrefix(pub, "U") {
			t.Errorf("%s: public key %s, returned %s", id, pub, pubs[id])
		}
		if line := deploykeys.EnvName(id) + "=" + pub + "\n"; !strings.Contains(string(env), line) {
			t.Errorf("%s lacks %q", deploykeys.EnvFile, line)
		}
	}
	if deploykeys.EnvName("agent-kvm-host-2") != "AGENT_KVM_HOST_2_NKEY" {
		t.Errorf("EnvName: %s", deploykeys.EnvName("agent-kvm-host-2"))
	}
	for _, secret := range []string{deploykeys.CAKey, deploykeys.ServerKey, deploykeys.ClientKey} {
		if st, _ := os.Stat(filepath.Join(dir, secret)); st == nil || st.Mode().Perm() != 0o600 {
			t.Errorf("%s is not mode 0600", secret)
		}
	}

	// The server certificate verifies against the CA for its hosts only,
	// and a TLS handshake with the client certificate works both ways.
	caPEM, _ := os.ReadFile(filepath.Join(dir, deploykeys.CACert))
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		t.Fatal("ca.crt holds no certificate")
	}
	serverCert, err := tls.LoadX509KeyPair(filepath.Join(dir, deploykeys.ServerCert), filepath.Join(dir, deploykeys.ServerKey))
	if err != nil {
		t.Fatal(err)
	}
	clientCert, err := tls.LoadX509KeyPair(filepath.Join(dir, deploykeys.ClientCert), filepath.Join(dir, deploykeys.ClientKey))
	if err != nil {
		t.Fatal(err)
	}
	leaf, _ := x509.ParseCertificate(serverCert.Certificate[0])
	for host, ok := range map[string]bool{"nats.test": true, "127.0.0.1": true, "other.test": false} {
		_, err := leaf.Verify(x509.VerifyOptions{Roots: pool, DNSName: host})
		if (err == nil) != ok {
			t.Errorf("server certificate for %s: %v, want ok=%v", host, err, ok)
		}
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{serverCert}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		done <- c.(*tls.Conn).Handshake()
	}()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	c, err := tls.Dial("tcp", "127.0.0.1:"+port, &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{clientCert}})
	if err != nil {
		t.Fatalf("client handshake: %v", err)
	}
	c.Close()
	if err := <-done; err != nil {
		t.Fatalf("server handshake with the client certificate: %v", err)
	}

	// Existing keys are never overwritten.
	if _, err := deploykeys.Generate(deploykeys.Options{Dir: dir}); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Fatalf("second run: %v, want a refusal to overwrite", err)
	}
}

func TestGenerateBadInput(t *testing.T) {
	if _, err := deploykeys.Generate(deploykeys.Options{}); err == nil {
		t.Error("no directory accepted")
	}
	if _, err := deploykeys.Generate(deploykeys.Options{Dir: t.TempDir(), Agents: []string{"local.t1"}}); err == nil || !strings.Contains(err.Error(), "ENTRY/TARGET") {
		t.Errorf("bad agent: %v", err)
	}
}

func TestGenerateGateways(t *testing.T) {
	dir := t.TempDir()
	if _, err := deploykeys.Generate(deploykeys.Options{Dir: dir, Gateways: []string{"gw-1", "east_2"}}); err != nil {
		t.Fatal(err)
	}
	accounts, err := os.ReadFile(filepath.Join(dir, deploykeys.AccountsFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range []string{"gw-1", "east_2"} {
		if _, err := os.Stat(filepath.Join(dir, deploykeys.GatewayIdentity(g)+".nk")); err != nil {
			t.Errorf("no seed for gateway %s: %v", g, err)
		}
		for _, want := range []string{"$" + deploykeys.EnvName(deploykeys.GatewayIdentity(g)), `"$KV.fleet-demand.*.` + g + `"`, `"fleet.gateway.log.` + g + `"`,
			`"fleet.gateway.` + g + `.info"`, `"_INBOX_gateway-` + g + `.>"`} {
			if !strings.Contains(string(accounts), want) {
				t.Errorf("%s lacks %s", deploykeys.AccountsFile, want)
			}
		}
	}
	// No wildcard in a gateway's own tokens: each names only itself.
	for _, wide := range []string{`"$KV.fleet-demand.*.*"`, `"fleet.gateway.*.`, `"fleet.gateway.log.*"`, `"fleet.gateway.log.>"`, `"_INBOX_gateway.>"`} {
		if strings.Contains(string(accounts), wide) {
			t.Errorf("%s grants a gateway %s", deploykeys.AccountsFile, wide)
		}
	}
}

func TestGenerateGatewaysBadInput(t *testing.T) {
	for _, tc := range []struct {
		gateways []string
		want     string
	}{
		{[]string{"gw.1"}, "letters, digits"},
		{[]string{"log"}, "reserved"},
		{[]string{"gw-1", "gw_1"}, "share the variable"},
		{[]string{"gw-1", "gw-1"}, "share the variable"},
	} {
		dir := filepath.Join(t.TempDir(), "s")
		_, err := deploykeys.Generate(deploykeys.Options{Dir: dir, Gateways: tc.gateways})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("gateways %v: %v, want an error saying %q", tc.gateways, err, tc.want)
		}
		if _, serr := os.Stat(dir); serr == nil {
			t.Errorf("gateways %v: the refused run created %s", tc.gateways, dir)
		}
	}
}
