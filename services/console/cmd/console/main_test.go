package main

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"
)

func TestParseFlags(t *testing.T) {
	f, err := parse([]string{"--nats-url", "nats://127.0.0.1:4222"})
	if err != nil {
		t.Fatal(err)
	}
	if f.listen != "127.0.0.1:8090" || f.pageSize != 100 || f.users != nil || f.usersFile != "" {
		t.Fatalf("defaults: %+v", f)
	}
	h, err := bcrypt.GenerateFromPassword([]byte("a long password"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	good := filepath.Join(dir, "users")
	if err := os.WriteFile(good, []byte("# the console's users\nana:operator:"+string(h)+"\n\nvic:viewer:"+string(h)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err = parse([]string{"--listen", "0.0.0.0:8090", "--users", good, "--page-size", "50"})
	if err != nil {
		t.Fatal(err)
	}
	if len(f.users) != 2 || f.users["ana"].Role != "operator" || f.users["vic"].Role != "viewer" || f.pageSize != 50 {
		t.Fatalf("users file: %+v", f.users)
	}
	bad := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--listen", "0.0.0.0:8090"}, "--listen 0.0.0.0:8090 is not loopback: give --users"},
		{[]string{"--listen", "[::]:8090"}, "is not loopback"},
		{[]string{"--listen", "nope"}, `--listen "nope": want host:port`},
		{[]string{"--page-size", "0"}, "--page-size 0: want 1 to 1000"},
		{[]string{"--tail", "5"}, "--tail 5: want 100 to 100000"},
		{[]string{"--history-every", "10ms"}, "--history-every 10ms: want at least 1s"},
		{[]string{"--users", filepath.Join(dir, "missing")}, "--users: users file: open"},
		{[]string{"--users", bad("noroles", "ana:"+string(h)+"\n")}, "noroles line 1: want name:role:bcrypt-hash"},
		{[]string{"--users", bad("badrole", "# x\nana:admin:"+string(h)+"\n")}, "badrole line 2: user ana: role \"admin\": want viewer or operator"},
		{[]string{"--users", bad("plain", "ana:operator:secret\n")}, "plain line 1: user ana: the hash is not a bcrypt hash (make one with console --hash-password)"},
		{[]string{"--users", bad("short", "ana\n")}, "short line 1: want name:role:bcrypt-hash"},
		{[]string{"--users", bad("dup", "ana:viewer:"+string(h)+"\nana:operator:"+string(h)+"\n")}, "dup line 2: user ana appears twice"},
		{[]string{"--users", bad("empty", "# nobody\n")}, "holds no user"},
		{[]string{"stray"}, "unexpected arguments"},
	} {
		_, err := parse(tc.args)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parse %q: got %v, want an error containing %q", tc.args, err, tc.want)
		}
	}
	// A password never appears in an error about the file.
	if _, err := parse([]string{"--users", bad("leak", "ana:operator:hunter2hunter2\n")}); err == nil || strings.Contains(err.Error(), "hunter2") {
		t.Errorf("an error quotes the file's hash field: %v", err)
	}
}

func TestHashPassword(t *testing.T) {
	f, err := parse([]string{"--hash-password"})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := run(f, strings.NewReader("correct horse battery\n"), &out); err != nil {
		t.Fatal(err)
	}
	h := strings.TrimSpace(out.String())
	if err := bcrypt.CompareHashAndPassword([]byte(h), []byte("correct horse battery")); err != nil {
		t.Fatalf("the printed hash %q does not match the password: %v", h, err)
	}
	if cost, _ := bcrypt.Cost([]byte(h)); cost < 12 {
		t.Errorf("bcrypt cost %d, want at least 12", cost)
	}
	for in, want := range map[string]string{"": "no password on stdin", "short\n": "want at least 10"} {
		if err := run(f, strings.NewReader(in), &out); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("stdin %q: got %v, want %q", in, err, want)
		}
	}
}

func TestParseTLSFlags(t *testing.T) {
	for _, args := range [][]string{{"--tls-cert", "c.pem"}, {"--tls-key", "k.pem"}} {
		if _, err := parse(args); err == nil || !strings.Contains(err.Error(), "--tls-cert and --tls-key go together") {
			t.Errorf("parse %q: got %v, want both or neither", args, err)
		}
	}
	if _, err := parse([]string{"--tls-cert", "missing.pem", "--tls-key", "missing.key"}); err == nil || !strings.Contains(err.Error(), "--tls-cert missing.pem") {
		t.Errorf("missing files: got %v, want an error naming --tls-cert", err)
	}
	// A certificate and its key: HTTPS, also beyond loopback with users.
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "console"}, NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), DNSNames: []string{"console.example"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cert, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	if err := os.WriteFile(cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := parse([]string{"--tls-cert", cert, "--tls-key", keyFile})
	if err != nil || f.tls == nil || len(f.tls.Certificates) != 1 || f.tls.MinVersion != tls.VersionTLS12 {
		t.Fatalf("--tls-cert and --tls-key: %+v, %v", f, err)
	}
	if _, err := parse([]string{"--tls-cert", keyFile, "--tls-key", cert}); err == nil {
		t.Error("the certificate and key swapped: no error")
	}
}
