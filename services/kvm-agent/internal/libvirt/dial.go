package libvirt

import (
	"context"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"

	"proxyfleet/pkg/agent"
)

// DefaultSocket is libvirtd's system socket.
const DefaultSocket = "/run/libvirt/libvirt-sock"

// Dialer opens a byte stream to libvirtd's RPC socket.
type Dialer interface {
	Dial(ctx context.Context) (net.Conn, error)
	String() string
}

// LocalDialer dials libvirtd's unix socket on this machine.
type LocalDialer struct{ Socket string }

// Dial connects to the socket.
func (d LocalDialer) Dial(ctx context.Context) (net.Conn, error) {
	var nd net.Dialer
	return nd.DialContext(ctx, "unix", d.Socket)
}

func (d LocalDialer) String() string { return "unix:" + d.Socket }

// SSHDialer reaches libvirtd's unix socket on a remote host through an SSH
// session. The key and known_hosts files are read on every dial, so fixing
// them heals the connection without a restart.
type SSHDialer struct {
	Addr           string // host:port
	User           string
	KeyFile        string
	KnownHostsFile string
	Socket         string        // remote socket path (default DefaultSocket)
	Keepalive      time.Duration // default 15s
}

func (d SSHDialer) String() string { return "ssh://" + d.User + "@" + d.Addr }

// Dial opens the SSH session and forwards the remote socket.
func (d SSHDialer) Dial(ctx context.Context) (net.Conn, error) {
	// A missing file may appear later (a secret mounted after start):
	// transient. A file that does not parse will not heal by retrying.
	key, err := os.ReadFile(d.KeyFile)
	if err != nil {
		return nil, agent.Wrap(agent.ErrTransient, fmt.Errorf("ssh key: %w", err))
	}
	signer, err := ssh.ParsePrivateKey(key)
	if err != nil {
		return nil, agent.Wrap(agent.ErrPermanent, fmt.Errorf("ssh key %s: %w", d.KeyFile, err))
	}
	if _, err := os.Stat(d.KnownHostsFile); err != nil {
		return nil, agent.Wrap(agent.ErrTransient, fmt.Errorf("ssh known_hosts: %w", err))
	}
	hostKeys, err := knownhosts.New(d.KnownHostsFile)
	if err != nil {
		return nil, agent.Wrap(agent.ErrPermanent, fmt.Errorf("ssh known_hosts: %w", err))
	}
	var nd net.Dialer
	tcp, err := nd.DialContext(ctx, "tcp", d.Addr)
	if err != nil {
		return nil, fmt.Errorf("ssh tcp: %w", err)
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = tcp.SetDeadline(dl)
	}
	cc, chans, reqs, err := ssh.NewClientConn(tcp, d.Addr, &ssh.ClientConfig{
		User:            d.User,
		Auth:            []ssh.AuthMethod{ssh.PublicKeys(signer)},
		HostKeyCallback: hostKeys,
	})
	if err != nil {
		_ = tcp.Close()
		return nil, fmt.Errorf("ssh handshake: %w", err)
	}
	_ = tcp.SetDeadline(time.Time{})
	client := ssh.NewClient(cc, chans, reqs)
	sock := d.Socket
	if sock == "" {
		sock = DefaultSocket
	}
	ch, err := client.Dial("unix", sock)
	if err != nil {
		_ = client.Close()
		return nil, fmt.Errorf("ssh forward %s: %w", sock, err)
	}
	s := &sshConn{Conn: ch, client: client, done: make(chan struct{})}
	every := d.Keepalive
	if every <= 0 {
		every = 15 * time.Second
	}
	go s.keepalive(every)
	return s, nil
}

// sshConn is the forwarded socket. Close closes the SSH client only: closing
// the forwarded channel writes a close message under a lock a stalled
// stream writer may hold, while closing the client unblocks that writer.
type sshConn struct {
	net.Conn
	client *ssh.Client
	once   sync.Once
	done   chan struct{}
}

func (s *sshConn) Close() error {
	var err error
	s.once.Do(func() {
		close(s.done)
		err = s.client.Close()
	})
	return err
}

// keepalive closes the session when the server stops answering.
func (s *sshConn) keepalive(every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-s.done:
			return
		case <-t.C:
			res := make(chan error, 1)
			go func() { _, _, err := s.client.SendRequest("keepalive@openssh.com", true, nil); res <- err }()
			select {
			case err := <-res:
				if err != nil {
					_ = s.Close()
					return
				}
			case <-time.After(every):
				_ = s.Close()
				return
			case <-s.done:
				return
			}
		}
	}
}
