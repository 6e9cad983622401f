package libvirt

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/testwait"
)

// sshServer accepts one client key and forwards direct-streamlocal channels
// to unix sockets, as OpenSSH does for "ssh -L local:/remote.sock".
type sshServer struct {
	addr    string
	hostKey ssh.Signer
	wg      sync.WaitGroup
	ln      net.Listener
}

func startSSHServer(t *testing.T, clientKey ssh.PublicKey) *sshServer {
	t.Helper()
	_, hk, _ := ed25519.GenerateKey(rand.Reader)
	hostSigner, err := ssh.NewSignerFromKey(hk)
	if err != nil {
		t.Fatal(err)
	}
	cfg := &ssh.ServerConfig{PublicKeyCallback: func(_ ssh.ConnMetadata, k ssh.PublicKey) (*ssh.Permissions, error) {
		if string(k.Marshal()) == string(clientKey.Marshal()) {
			return nil, nil
		}
		return nil, errors.New("unknown key")
	}}
	cfg.AddHostKey(hostSigner)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &sshServer{addr: ln.Addr().String(), hostKey: hostSigner, ln: ln}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.wg.Add(1)
			go func() { defer s.wg.Done(); s.serve(c, cfg) }()
		}
	}()
	t.Cleanup(func() { ln.Close(); s.wg.Wait() })
	return s
}

func (s *sshServer) serve(c net.Conn, cfg *ssh.ServerConfig) {
	defer c.Close()
	sc, chans, reqs, err := ssh.NewServerConn(c, cfg)
	if err != nil {
		return
	}
	defer sc.Close()
	go ssh.DiscardRequests(reqs)
	for nc := range chans {
		if nc.ChannelType() != "direct-streamlocal@openssh.com" {
			_ = nc.Reject(ssh.UnknownChannelType, "no")
			continue
		}
		var p struct {
			Path      string
			Reserved0 string
			Reserved1 uint32
		}
		if err := ssh.Unmarshal(nc.ExtraData(), &p); err != nil {
			_ = nc.Reject(ssh.ConnectionFailed, "bad payload")
			continue
		}
		up, err := net.Dial("unix", p.Path)
		if err != nil {
			_ = nc.Reject(ssh.ConnectionFailed, err.Error())
			continue
		}
		ch, creqs, err := nc.Accept()
		if err != nil {
			up.Close()
			continue
		}
		go ssh.DiscardRequests(creqs)
		go func() { _, _ = io.Copy(ch, up); ch.Close() }()
		go func() { _, _ = io.Copy(up, ch); up.Close() }()
	}
}

// echoSocket serves a unix socket that echoes.
func echoSocket(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "libvirt-sock")
	ln, err := net.Listen("unix", p)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() { defer wg.Done(); _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return p
}

func writeKey(t *testing.T, dir string) (string, ssh.PublicKey) {
	t.Helper()
	_, k, _ := ed25519.GenerateKey(rand.Reader)
	block, err := ssh.MarshalPrivateKey(k, "")
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "id_ed25519")
	if err := os.WriteFile(p, pem.EncodeToMemory(block), 0o600); err != nil {
		t.Fatal(err)
	}
	signer, _ := ssh.NewSignerFromKey(k)
	return p, signer.PublicKey()
}

func TestSSHDialerForwardsTheSocketAndChecksTheHostKey(t *testing.T) {
	dir := t.TempDir()
	keyFile, pub := writeKey(t, dir)
	srv := startSSHServer(t, pub)
	sock := echoSocket(t)

	good := filepath.Join(dir, "known_hosts")
	line := knownhosts.Line([]string{knownhosts.Normalize(srv.addr)}, srv.hostKey.PublicKey())
	if err := os.WriteFile(good, []byte(line+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, other, _ := ed25519.GenerateKey(rand.Reader)
	otherSigner, _ := ssh.NewSignerFromKey(other)
	bad := filepath.Join(dir, "known_hosts.bad")
	if err := os.WriteFile(bad, []byte(knownhosts.Line([]string{knownhosts.Normalize(srv.addr)}, otherSigner.PublicKey())+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	garbage := filepath.Join(dir, "garbage")
	if err := os.WriteFile(garbage, []byte("not a key\n@@@ ssh-rsa !!!\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	ctx := testwait.Context(t, 10*time.Second)
	d := SSHDialer{Addr: srv.addr, User: "proxyfleet", KeyFile: keyFile, KnownHostsFile: good, Socket: sock}
	c, err := d.Dial(ctx)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("echo = %q, %v", buf, err)
	}
	if err := c.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}

	tests := []struct {
		name  string
		d     SSHDialer
		want  string
		class string
	}{
		{"host key not the known one", SSHDialer{Addr: srv.addr, User: "u", KeyFile: keyFile, KnownHostsFile: bad, Socket: sock}, "ssh handshake", agent.ClassTransient},
		{"known_hosts missing", SSHDialer{Addr: srv.addr, User: "u", KeyFile: keyFile, KnownHostsFile: filepath.Join(dir, "nope"), Socket: sock}, "known_hosts", agent.ClassTransient},
		{"known_hosts unparsable", SSHDialer{Addr: srv.addr, User: "u", KeyFile: keyFile, KnownHostsFile: garbage, Socket: sock}, "known_hosts", agent.ClassPermanent},
		{"key missing", SSHDialer{Addr: srv.addr, User: "u", KeyFile: filepath.Join(dir, "nokey"), KnownHostsFile: good, Socket: sock}, "ssh key", agent.ClassTransient},
		{"key unparsable", SSHDialer{Addr: srv.addr, User: "u", KeyFile: garbage, KnownHostsFile: good, Socket: sock}, "ssh key", agent.ClassPermanent},
		{"remote socket missing", SSHDialer{Addr: srv.addr, User: "u", KeyFile: keyFile, KnownHostsFile: good, Socket: "/nonexistent/sock"}, "ssh forward", agent.ClassTransient},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := tc.d.Dial(ctx)
			if err == nil {
				c.Close()
				t.Fatal("Dial succeeded")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want it to mention %q", err, tc.want)
			}
			if got := agent.Classify(err); got != tc.class {
				t.Errorf("class = %q, want %q", got, tc.class)
			}
		})
	}
}
