package nfdelay_test

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"proxyfleet/e2e/internal/nfdelay"
	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testwait"
)

// pair is two network namespaces joined by a veth pair: a (.1) and b (.2).
type pair struct {
	a, b       string
	linkA      string
	ipA, ipB   string
	echoAddr   string // TCP echo server in b
	udpAddr    string // UDP sink in b
	udpPackets chan uint32
}

func run(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func newPair(t *testing.T) *pair {
	t.Helper()
	testgate.Need(t, os.Geteuid() == 0, "the delayer test creates network namespaces and binds an NFQUEUE queue: run it as root")
	testgate.NeedBinary(t, "ip", "the delayer test needs iproute2")
	testgate.NeedBinary(t, "iptables", "the delayer test needs iptables")
	pid := os.Getpid()
	p := &pair{a: fmt.Sprintf("pfd%d-a", pid), b: fmt.Sprintf("pfd%d-b", pid), linkA: fmt.Sprintf("pfda%d", pid),
		ipA: fmt.Sprintf("10.202.%d.1", pid%250), ipB: fmt.Sprintf("10.202.%d.2", pid%250)}
	for _, ns := range []string{p.a, p.b} {
		run(t, "ip", "netns", "add", ns)
		t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
		run(t, "ip", "-n", ns, "link", "set", "lo", "up")
	}
	linkB := fmt.Sprintf("pfdb%d", pid)
	run(t, "ip", "-n", p.a, "link", "add", p.linkA, "type", "veth", "peer", "name", linkB, "netns", p.b)
	run(t, "ip", "-n", p.a, "addr", "add", p.ipA+"/24", "dev", p.linkA)
	run(t, "ip", "-n", p.b, "addr", "add", p.ipB+"/24", "dev", linkB)
	run(t, "ip", "-n", p.a, "link", "set", p.linkA, "up")
	run(t, "ip", "-n", p.b, "link", "set", linkB, "up")

	// In b: a TCP echo server and a UDP sink that reports each datagram's
	// sequence number.
	var ln net.Listener
	var pc net.PacketConn
	if err := nfdelay.InNetns(p.b, func() (err error) {
		if ln, err = net.Listen("tcp", p.ipB+":0"); err != nil {
			return err
		}
		pc, err = net.ListenPacket("udp", p.ipB+":0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close(); pc.Close() })
	p.echoAddr, p.udpAddr = ln.Addr().String(), pc.LocalAddr().String()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); _, _ = io.Copy(c, c) }()
		}
	}()
	p.udpPackets = make(chan uint32, 1024)
	go func() {
		buf := make([]byte, 64)
		for {
			n, _, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			if n >= 4 {
				p.udpPackets <- binary.BigEndian.Uint32(buf[:4])
			}
		}
	}()
	return p
}

// dialFromA opens a connection from a's namespace.
func (p *pair) dialFromA(t *testing.T, network, addr string) net.Conn {
	t.Helper()
	var c net.Conn
	if err := nfdelay.InNetns(p.a, func() (err error) {
		c, err = net.DialTimeout(network, addr, 10*time.Second)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// rtts measures n round trips of one byte over an established TCP
// connection to b's echo server.
func rtts(t *testing.T, c net.Conn, n int) []time.Duration {
	t.Helper()
	var out []time.Duration
	b := []byte{'x'}
	for range n {
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		start := time.Now()
		if _, err := c.Write(b); err != nil {
			t.Fatalf("write to the echo server: %v", err)
		}
		if _, err := io.ReadFull(c, b); err != nil {
			t.Fatalf("read from the echo server: %v", err)
		}
		out = append(out, time.Since(start))
	}
	return out
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

// TestDelayerHoldsEachPacket starts a delayer for a's side of a veth pair
// and checks that it delays and keeps every packet: the round trip of a
// byte over TCP grows by the delay (every sample at least the delay,
// since the echo's request is held once on its way out of a; the median
// under twice the delay, so it is held once and not twice), numbered UDP
// datagrams all arrive and in the order sent, and once the rule is gone
// and the delayer closed the round trip is back below the delay. The
// bounds are the delay's correctness (held at least that long, held
// once), not performance timings: the upper one leaves a whole delay of
// slack for a busy machine.
func TestDelayerHoldsEachPacket(t *testing.T) {
	p := newPair(t)
	const delay = 200 * time.Millisecond
	const queue = 7
	conn := p.dialFromA(t, "tcp", p.echoAddr)
	base := median(rtts(t, conn, 10))
	t.Logf("round trip without the delayer: %s (median of 10)", base)
	if base >= delay {
		t.Fatalf("round trip over the veth pair is %s before any delay, not below the %s the test measures", base, delay)
	}

	d, err := nfdelay.Start(p.a, queue, delay)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	rule := []string{"OUTPUT", "-o", p.linkA, "-j", "NFQUEUE", "--queue-num", fmt.Sprint(queue), "--queue-bypass"}
	run(t, append([]string{"ip", "netns", "exec", p.a, "iptables", "-w", "-A"}, rule...)...)

	delayed := rtts(t, conn, 10)
	for i, r := range delayed {
		if r < delay {
			t.Errorf("round trip %d with the delayer: %s, shorter than the %s delay: a packet was not held", i, r, delay)
		}
	}
	if m := median(delayed); m >= 2*delay {
		t.Errorf("median round trip with the delayer: %s, want under %s (one hold of %s; %s without)", m, 2*delay, delay, base)
	} else {
		t.Logf("round trip with a %s delayer: %s (median of 10; %s without)", delay, m, base)
	}

	// Every datagram through, in the order sent.
	const n = 200
	uc := p.dialFromA(t, "udp", p.udpAddr)
	for i := range uint32(n) {
		b := make([]byte, 4)
		binary.BigEndian.PutUint32(b, i)
		if _, err := uc.Write(b); err != nil {
			t.Fatalf("send datagram %d: %v", i, err)
		}
	}
	var got []uint32
	timeout := time.After(10 * time.Second)
	for len(got) < n {
		select {
		case s := <-p.udpPackets:
			got = append(got, s)
		case <-timeout:
			t.Fatalf("%d of %d datagrams arrived through the delayer within 10s", len(got), n)
		}
	}
	for i, s := range got {
		if s != uint32(i) {
			t.Fatalf("datagram %d arrived as number %d: the delayer reordered packets (%v…)", i, s, got[:min(len(got), i+5)])
		}
	}
	// The delayer counts a packet accepted once its verdict is sent, so
	// the last datagram can arrive before its count: wait for it.
	var queued, accepted uint64
	if err := testwait.For(testwait.Context(t, 5*time.Second), func() bool {
		queued, accepted = d.Counts()
		return queued >= n+10 && accepted >= n+10
	}); err != nil {
		t.Errorf("the delayer counts %d queued, %d accepted; at least %d went through it", queued, accepted, n+10)
	}

	run(t, append([]string{"ip", "netns", "exec", p.a, "iptables", "-w", "-D"}, rule...)...)
	if err := d.Err(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatalf("close the delayer: %v", err)
	}
	if after := median(rtts(t, conn, 10)); after >= delay {
		t.Errorf("round trip after the delayer closed: %s, want below %s again", after, delay)
	}
}

// TestDelayerBusyQueue: a second delayer on a queue that one already holds
// in the same namespace is refused with an error naming the queue.
func TestDelayerBusyQueue(t *testing.T) {
	p := newPair(t)
	d, err := nfdelay.Start(p.a, 9, time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d2, err := nfdelay.Start(p.a, 9, time.Millisecond); err == nil {
		d2.Close()
		t.Fatal("a second delayer bound queue 9 in the same namespace")
	} else if !strings.Contains(err.Error(), "queue 9") {
		t.Fatalf("second delayer on queue 9: %v, want an error naming the queue", err)
	}
	// Another namespace has queues of its own.
	d3, err := nfdelay.Start(p.b, 9, time.Millisecond)
	if err != nil {
		t.Fatalf("queue 9 in another namespace: %v", err)
	}
	d3.Close()
}
