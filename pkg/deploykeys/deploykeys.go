// Package deploykeys generates the credentials of a deployment under
// deploy/nats: one nkey per identity (a seed file each, an env file of
// the public keys the server configuration names, and the server's
// accounts block naming those identities, with each gateway's own
// permissions), and a private CA with a server certificate and a client
// certificate for TLS. `make deploy-secrets` runs it.
package deploykeys

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/nats-io/nkeys"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// Fixed identities of deploy/nats; agents and gateways add one each
// (agent-<entry>-<target>, [GatewayIdentity]).
var Fixed = []string{"admin", "planner", "health", "operator", "console", "backup"}

// EnvFile is the file of public keys the server reads its variables from.
const EnvFile = "nkeys.env"

// Files written besides the seeds (<identity>.nk).
const (
	CACert     = "ca.crt"
	CAKey      = "ca.key"
	ServerCert = "server.crt"
	ServerKey  = "server.key"
	ClientCert = "client.crt"
	ClientKey  = "client.key"
)

// Options say what to generate.
type Options struct {
	// Dir receives the files; it is created (mode 0700) when missing.
	Dir string
	// Agents are "entry/target", one identity agent-<entry>-<target> each.
	Agents []string
	// Gateways are the gateways' names (their --name), one identity
	// gateway-<name> each (default: [DefaultGateway]).
	Gateways []string
	// Hosts are the DNS names and IP addresses of the NATS server
	// certificate (default: localhost, 127.0.0.1, ::1).
	Hosts []string
	// Validity of the certificates (default 825 days).
	Validity time.Duration
}

// Identity returns the identity name of an agent: agent-<entry>-<target>.
func Identity(entry, target string) string { return bus.AgentConsumerName(entry, target) }

// EnvName is the variable deploy/nats reads an identity's public key from:
// "agent-local-t1" -> AGENT_LOCAL_T1_NKEY.
func EnvName(identity string) string {
	return strings.NewReplacer("-", "_", ".", "_").Replace(strings.ToUpper(identity)) + "_NKEY"
}

// Generate writes the seeds, the env file and the certificates into
// o.Dir, and returns the public key of each identity. It refuses to
// overwrite an existing seed or key: rotating credentials is a decision.
func Generate(o Options) (map[string]string, error) {
	if o.Dir == "" {
		return nil, errors.New("no output directory (DIR=...)")
	}
	ids := append([]string(nil), Fixed...)
	var agents []string
	for _, a := range o.Agents {
		entry, target, err := bus.ParseAgent(a)
		if err != nil {
			return nil, err
		}
		agents = append(agents, Identity(entry, target))
	}
	ids = append(ids, agents...)
	if len(o.Gateways) == 0 {
		o.Gateways = []string{DefaultGateway}
	}
	for _, g := range o.Gateways {
		if err := events.CheckGatewayName(g); err != nil {
			return nil, err
		}
		ids = append(ids, GatewayIdentity(g))
	}
	// Two identities must not share a variable: gw-1 and gw_1 would.
	vars := map[string]string{}
	for _, id := range ids {
		if other, dup := vars[EnvName(id)]; dup {
			return nil, fmt.Errorf("identities %s and %s would share the variable %s: give each agent and gateway once, and gateway names that differ by more than '-' and '_'", other, id, EnvName(id))
		}
		vars[EnvName(id)] = id
	}
	if len(o.Hosts) == 0 {
		o.Hosts = []string{"localhost", "127.0.0.1", "::1"}
	}
	if o.Validity == 0 {
		o.Validity = 825 * 24 * time.Hour
	}
	if err := os.MkdirAll(o.Dir, 0o700); err != nil {
		return nil, err
	}
	if _, err := os.Stat(filepath.Join(o.Dir, AccountsFile)); err == nil {
		return nil, fmt.Errorf("%s already exists: remove the directory's old credentials first, or use another DIR", filepath.Join(o.Dir, AccountsFile))
	}
	for _, f := range append(append([]string{}, ids...), "ca", "server", "client") {
		name := f + ".nk"
		switch f {
		case "ca", "server", "client":
			name = f + ".key"
		}
		if _, err := os.Stat(filepath.Join(o.Dir, name)); err == nil {
			return nil, fmt.Errorf("%s already exists: remove the directory's old credentials first, or use another DIR", filepath.Join(o.Dir, name))
		}
	}
	pubs := map[string]string{}
	for _, id := range ids {
		kp, err := nkeys.CreateUser()
		if err != nil {
			return nil, err
		}
		seed, err := kp.Seed()
		if err != nil {
			return nil, err
		}
		pub, err := kp.PublicKey()
		if err != nil {
			return nil, err
		}
		if err := write(o.Dir, id+".nk", append(seed, '\n'), 0o600); err != nil {
			return nil, err
		}
		pubs[id] = pub
	}
	var env strings.Builder
	env.WriteString("# Public nkeys of the identities in deploy/nats (not secret).\n")
	names := make([]string, 0, len(pubs))
	for id := range pubs {
		names = append(names, id)
	}
	sort.Strings(names)
	for _, id := range names {
		fmt.Fprintf(&env, "%s=%s\n", EnvName(id), pubs[id])
	}
	if err := write(o.Dir, EnvFile, []byte(env.String()), 0o644); err != nil {
		return nil, err
	}
	if err := write(o.Dir, AccountsFile, []byte(Accounts(agents, o.Gateways)), 0o644); err != nil {
		return nil, err
	}
	if err := certs(o); err != nil {
		return nil, err
	}
	return pubs, nil
}

func certs(o Options) error {
	now := time.Now().Add(-time.Hour)
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "proxyfleet NATS CA"},
		NotBefore:             now,
		NotAfter:              now.Add(o.Validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return err
	}
	if err := writeCert(o.Dir, CACert, CAKey, caDER, caKey); err != nil {
		return err
	}
	leaf := func(cn string, usage x509.ExtKeyUsage, hosts []string, certFile, keyFile string) error {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return err
		}
		tmpl := &x509.Certificate{
			SerialNumber: serial(),
			Subject:      pkix.Name{CommonName: cn},
			NotBefore:    now,
			NotAfter:     now.Add(o.Validity),
			KeyUsage:     x509.KeyUsageDigitalSignature,
			ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		}
		for _, h := range hosts {
			if ip := net.ParseIP(h); ip != nil {
				tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
			} else {
				tmpl.DNSNames = append(tmpl.DNSNames, h)
			}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			return err
		}
		return writeCert(o.Dir, certFile, keyFile, der, key)
	}
	// The server certificate also serves routes between cluster members,
	// which present it as clients.
	if err := leaf("proxyfleet NATS server", x509.ExtKeyUsageServerAuth, o.Hosts, ServerCert, ServerKey); err != nil {
		return err
	}
	if err := leaf("proxyfleet NATS client", x509.ExtKeyUsageClientAuth, nil, ClientCert, ClientKey); err != nil {
		return err
	}
	return nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand does not fail
	}
	return n
}

func writeCert(dir, certFile, keyFile string, der []byte, key *ecdsa.PrivateKey) error {
	kb, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	if err := write(dir, keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kb}), 0o600); err != nil {
		return err
	}
	return write(dir, certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
}

func write(dir, name string, b []byte, mode os.FileMode) error {
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
