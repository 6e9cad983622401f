// Package nfdelay delays packets in userspace: a listener on an NFQUEUE
// queue that holds every packet the kernel queues to it for a fixed time,
// then accepts it, in the order the packets came. It is the partition
// tier's latency fault where the kernel has no netem qdisc: an iptables
// rule such as
//
//	iptables -A OUTPUT -o eth0 -j NFQUEUE --queue-num 100 --queue-bypass
//
// in a network namespace sends the link's outgoing packets to queue 100,
// and a [Delayer] started for that namespace and queue holds each one for
// the delay.
//
// It speaks the nfnetlink_queue protocol on a raw NETLINK_NETFILTER socket
// (no library beyond golang.org/x/sys/unix): bind the queue, ask for the
// packets' metadata only (the payload is never copied to userspace nor
// changed), and answer each packet with an NF_ACCEPT verdict naming its id.
// Only a packet's id is kept while it is held.
package nfdelay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The nfnetlink_queue protocol (linux/netfilter/nfnetlink_queue.h,
// linux/netfilter/nfnetlink.h).
const (
	nfnlSubsysQueue = 3

	nfqnlMsgPacket  = 0
	nfqnlMsgVerdict = 1
	nfqnlMsgConfig  = 2

	nfqaPacketHdr  = 1 // struct nfqnl_msg_packet_hdr: __be32 id, __be16 hw_protocol, u8 hook
	nfqaVerdictHdr = 2 // struct nfqnl_msg_verdict_hdr: __be32 verdict, __be32 id

	nfqaCfgCmd         = 1 // struct nfqnl_msg_config_cmd: u8 command, u8 pad, __be16 pf
	nfqaCfgParams      = 2 // struct nfqnl_msg_config_params: __be32 copy_range, u8 copy_mode
	nfqaCfgQueueMaxlen = 3 // __be32
	nfqaCfgMask        = 4 // __be32
	nfqaCfgFlags       = 5 // __be32

	nfqnlCfgCmdBind   = 1
	nfqnlCfgCmdUnbind = 2

	nfqnlCopyMeta = 1

	// nfqaCfgFFailOpen: a packet the queue cannot take (full, or the
	// socket's buffer full) is accepted at once instead of dropped, so
	// the delayer never adds loss of its own. nfqaCfgFGSO: a GSO packet
	// is queued whole rather than segmented first (its payload is never
	// looked at).
	nfqaCfgFFailOpen = 1 << 0
	nfqaCfgFGSO      = 1 << 2

	nfAccept = 1
)

// MaxLen is the number of packets a queue may hold at once: generous, so
// that a busy link under a 200 ms delay never fills it (a full queue
// accepts packets undelayed, see nfqaCfgFFailOpen).
const MaxLen = 1 << 16

// Delayer holds the packets of one NFQUEUE queue in one network namespace
// for a fixed delay. Start it before the iptables rule that queues packets
// to it, and remove the rule before [Delayer.Close].
type Delayer struct {
	queue uint16
	delay time.Duration
	f     *os.File // the netlink socket, non-blocking, on the runtime's poller
	raw   syscall.RawConn

	held     chan heldPacket
	wg       sync.WaitGroup
	closing  atomic.Bool
	done     chan struct{} // closed by Close: the held packets are due now
	queued   atomic.Uint64
	accepted atomic.Uint64

	mu  sync.Mutex
	err error // the first error of the read or verdict loop
	seq uint32
}

type heldPacket struct {
	id  uint32
	due time.Time
}

// Start binds queue in the network namespace named netns (a file under
// /var/run/netns, as ip netns add creates; "" is the caller's namespace)
// and holds every packet queued to it for delay. It needs CAP_NET_ADMIN.
func Start(netns string, queue uint16, delay time.Duration) (*Delayer, error) {
	if delay < 0 {
		return nil, fmt.Errorf("nfdelay: delay %s is negative", delay)
	}
	fd, err := socketIn(netns)
	if err != nil {
		return nil, err
	}
	// A large receive buffer: with the queue fail-open, a packet the
	// socket cannot take goes through undelayed. SO_RCVBUFFORCE needs
	// CAP_NET_ADMIN, which binding a queue needs anyway; SO_RCVBUF is the
	// fallback (capped by net.core.rmem_max).
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 8<<20) != nil {
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 8<<20)
	}
	// ENOBUFS (the kernel dropped a message for us) is reported, not fatal.
	_ = unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_NO_ENOBUFS, 1)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("nfdelay: bind the netlink socket: %w", err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("nfdelay: set the netlink socket non-blocking: %w", err)
	}
	f := os.NewFile(uintptr(fd), fmt.Sprintf("nfqueue-%s-%d", netns, queue))
	raw, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("nfdelay: %w", err)
	}
	d := &Delayer{queue: queue, delay: delay, f: f, raw: raw, held: make(chan heldPacket, MaxLen), done: make(chan struct{})}
	if err := d.configure(); err != nil {
		f.Close()
		return nil, err
	}
	d.wg.Add(2)
	go d.readLoop()
	go d.verdictLoop()
	return d, nil
}

// socketIn opens a NETLINK_NETFILTER socket in the namespace netns. A
// socket stays in the namespace it was created in, whichever thread uses
// it later: the socket is created on a goroutine locked to its thread
// after setns(2) moves that thread into netns, and the goroutine then ends
// without unlocking, so the runtime terminates the thread instead of
// moving it back. Moving it back (setns to the saved namespace) could
// fail and leave a thread in the node's namespace that later runs any of
// the test's goroutines (a dial from it would leave from the wrong
// network); one thread per delayer is the whole cost.
func socketIn(netns string) (int, error) {
	if netns == "" {
		fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
		if err != nil {
			return -1, fmt.Errorf("nfdelay: open a NETLINK_NETFILTER socket: %w", err)
		}
		return fd, nil
	}
	var fd int
	err := InNetns(netns, func() error {
		var err error
		fd, err = unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
		if err != nil {
			return fmt.Errorf("nfdelay: open a NETLINK_NETFILTER socket in %s: %w", netns, err)
		}
		return nil
	})
	return fd, err
}

// InNetns runs fn on a thread in the network namespace named netns (under
// /var/run/netns) and returns its error. Sockets fn opens stay in netns;
// goroutines fn starts do not run in it. The thread is discarded when fn
// returns (see socketIn).
func InNetns(netns string, fn func() error) error {
	nsf, err := os.Open("/var/run/netns/" + netns)
	if err != nil {
		return fmt.Errorf("nfdelay: open network namespace %s: %w", netns, err)
	}
	defer nsf.Close()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if err := unix.Setns(int(nsf.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("nfdelay: enter network namespace %s: %w", netns, err)
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// configure binds the queue, copy mode meta, a long queue, fail-open and
// GSO, each acknowledged by the kernel.
func (d *Delayer) configure() error {
	cmd := func(c uint8) []byte {
		return attr(nfqaCfgCmd, []byte{c, 0, byte(unix.AF_INET >> 8), byte(unix.AF_INET & 0xff)})
	}
	if err := d.request(nfqnlMsgConfig, cmd(nfqnlCfgCmdBind)); err != nil {
		if errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("nfdelay: queue %d is bound by another listener in this namespace: %w", d.queue, err)
		}
		return fmt.Errorf("nfdelay: bind queue %d: %w", d.queue, err)
	}
	params := make([]byte, 5)
	binary.BigEndian.PutUint32(params, 0) // copy_range: nothing of the payload
	params[4] = nfqnlCopyMeta
	var body []byte
	body = append(body, attr(nfqaCfgParams, params)...)
	body = append(body, attr(nfqaCfgQueueMaxlen, be32(MaxLen))...)
	body = append(body, attr(nfqaCfgMask, be32(nfqaCfgFFailOpen|nfqaCfgFGSO))...)
	body = append(body, attr(nfqaCfgFlags, be32(nfqaCfgFFailOpen|nfqaCfgFGSO))...)
	if err := d.request(nfqnlMsgConfig, body); err != nil {
		return fmt.Errorf("nfdelay: configure queue %d (copy mode meta, max length %d, fail-open): %w", d.queue, MaxLen, err)
	}
	return nil
}

// request sends one message with NLM_F_ACK and waits for its
// acknowledgement (only before the read loop runs).
func (d *Delayer) request(msg uint16, body []byte) error {
	seq, err := d.send(msg, unix.NLM_F_ACK, body)
	if err != nil {
		return err
	}
	buf := make([]byte, 1<<16)
	deadline := time.Now().Add(5 * time.Second)
	if err := d.f.SetReadDeadline(deadline); err != nil {
		return err
	}
	defer func() { _ = d.f.SetReadDeadline(time.Time{}) }()
	for {
		n, err := d.recv(buf)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return errors.New("no acknowledgement from the kernel within 5s")
		}
		if err != nil {
			return err
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return fmt.Errorf("parse the kernel's answer: %w", err)
		}
		for _, m := range msgs {
			if m.Header.Seq != seq || m.Header.Type != unix.NLMSG_ERROR {
				continue
			}
			if len(m.Data) < 4 {
				return errors.New("short netlink error message")
			}
			if code := int32(binary.NativeEndian.Uint32(m.Data[:4])); code != 0 {
				return syscall.Errno(-code)
			}
			return nil
		}
	}
}

// send writes one nfnetlink_queue message for d's queue.
func (d *Delayer) send(msg uint16, flags uint16, body []byte) (uint32, error) {
	d.mu.Lock()
	d.seq++
	seq := d.seq
	d.mu.Unlock()
	b := make([]byte, unix.NLMSG_HDRLEN+4, unix.NLMSG_HDRLEN+4+len(body))
	b = append(b, body...)
	binary.NativeEndian.PutUint32(b[0:4], uint32(len(b)))
	binary.NativeEndian.PutUint16(b[4:6], nfnlSubsysQueue<<8|msg)
	binary.NativeEndian.PutUint16(b[6:8], unix.NLM_F_REQUEST|flags)
	binary.NativeEndian.PutUint32(b[8:12], seq)
	binary.NativeEndian.PutUint32(b[12:16], 0) // to the kernel
	// struct nfgenmsg: family AF_UNSPEC, version NFNETLINK_V0, the queue
	// number big-endian.
	b[16], b[17] = unix.AF_UNSPEC, 0
	binary.BigEndian.PutUint16(b[18:20], d.queue)
	var werr error
	err := d.raw.Write(func(fd uintptr) bool {
		werr = unix.Sendto(int(fd), b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
		return werr != unix.EAGAIN
	})
	if err == nil {
		err = werr
	}
	return seq, err
}

// recv reads one datagram, waiting on the poller.
func (d *Delayer) recv(buf []byte) (int, error) {
	var n int
	var rerr error
	err := d.raw.Read(func(fd uintptr) bool {
		n, _, rerr = unix.Recvfrom(int(fd), buf, 0)
		return rerr != unix.EAGAIN
	})
	if err == nil {
		err = rerr
	}
	return n, err
}

// readLoop takes the queued packets' ids and hands them to the verdict
// loop with the time each is due.
func (d *Delayer) readLoop() {
	defer d.wg.Done()
	defer close(d.held)
	buf := make([]byte, 1<<20)
	for {
		n, err := d.recv(buf)
		if err != nil {
			if d.closing.Load() {
				return
			}
			if errors.Is(err, unix.ENOBUFS) {
				continue // fail-open: what the kernel could not send us went through
			}
			d.fail(fmt.Errorf("nfdelay: read queue %d: %w", d.queue, err))
			return
		}
		now := time.Now()
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			d.fail(fmt.Errorf("nfdelay: parse a message of queue %d: %w", d.queue, err))
			return
		}
		for _, m := range msgs {
			if m.Header.Type != nfnlSubsysQueue<<8|nfqnlMsgPacket || len(m.Data) < 4 {
				continue
			}
			id, ok := packetID(m.Data[4:])
			if !ok {
				continue
			}
			d.queued.Add(1)
			d.held <- heldPacket{id: id, due: now.Add(d.delay)}
		}
	}
}

// packetID finds NFQA_PACKET_HDR among a packet message's attributes.
func packetID(b []byte) (uint32, bool) {
	for len(b) >= 4 {
		l := int(binary.NativeEndian.Uint16(b[0:2]))
		typ := binary.NativeEndian.Uint16(b[2:4]) & 0x3fff // without NLA_F_NESTED, NLA_F_NET_BYTEORDER
		if l < 4 || l > len(b) {
			return 0, false
		}
		if typ == nfqaPacketHdr && l >= 8 {
			return binary.BigEndian.Uint32(b[4:8]), true
		}
		b = b[min(len(b), (l+3)&^3):]
	}
	return 0, false
}

// verdictLoop accepts each packet when it is due, in the order they came
// (one delay for all: the order of arrival is the order of due times).
// Once the delayer closes, the packets still held are accepted at once.
func (d *Delayer) verdictLoop() {
	defer d.wg.Done()
	for p := range d.held {
		if wait := time.Until(p.due); wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-t.C:
			case <-d.done:
				t.Stop()
			}
		}
		body := make([]byte, 8)
		binary.BigEndian.PutUint32(body[0:4], nfAccept)
		binary.BigEndian.PutUint32(body[4:8], p.id)
		if _, err := d.send(nfqnlMsgVerdict, 0, attr(nfqaVerdictHdr, body)); err != nil {
			if d.closing.Load() {
				continue // the socket is gone: the kernel drops what it held
			}
			d.fail(fmt.Errorf("nfdelay: accept packet %d of queue %d: %w", p.id, d.queue, err))
			continue
		}
		d.accepted.Add(1)
	}
}

func (d *Delayer) fail(err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.err == nil {
		d.err = err
	}
}

// Err is the first error the delayer met since it started, nil if none.
// After an error packets may no longer be delayed (the queue's rule lets
// them through with --queue-bypass once the socket is closed).
func (d *Delayer) Err() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.err
}

// Counts returns how many packets the delayer has taken from the queue
// and how many it has accepted.
func (d *Delayer) Counts() (queued, accepted uint64) {
	return d.queued.Load(), d.accepted.Load()
}

// Delay is the time each packet is held.
func (d *Delayer) Delay() time.Duration { return d.delay }

// Close stops holding packets: the ones held are accepted at once, the
// queue is unbound and the socket closed. Remove the iptables rule first:
// packets queued after Close are dropped by the kernel, or let through
// undelayed where the rule has --queue-bypass.
func (d *Delayer) Close() error {
	if d.closing.Swap(true) {
		return nil
	}
	close(d.done)
	// The verdicts need the socket, which ends the read loop when closed:
	// first every packet taken is accepted (the verdict loop no longer
	// waits), then the queue is unbound (which drops what the kernel
	// still holds for it) and the socket closed.
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if q, a := d.Counts(); a >= q {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	_, _ = d.send(nfqnlMsgConfig, 0, attr(nfqaCfgCmd, []byte{nfqnlCfgCmdUnbind, 0, byte(unix.AF_INET >> 8), byte(unix.AF_INET & 0xff)}))
	err := d.f.Close()
	d.wg.Wait()
	return err
}

// attr encodes one netlink attribute, padded to 4 bytes.
func attr(typ uint16, data []byte) []byte {
	l := 4 + len(data)
	b := make([]byte, (l+3)&^3)
	binary.NativeEndian.PutUint16(b[0:2], uint16(l))
	binary.NativeEndian.PutUint16(b[2:4], typ)
	copy(b[4:], data)
	return b
}

func be32(v uint32) []byte {
	b := make([]byte, 4)
	binary.BigEndian.PutUint32(b, v)
	return b
}
