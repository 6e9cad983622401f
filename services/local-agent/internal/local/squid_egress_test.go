package local

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/squidtest"
	"proxyfleet/pkg/testgate"
)

// countingListener counts the connections it accepts.
type countingListener struct {
	net.Listener
	accepted atomic.Int32
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.accepted.Add(1)
	}
	return c, err
}

// serveCounting serves "ok" over HTTP on ln and counts its connections.
func serveCounting(t *testing.T, ln net.Listener) *countingListener {
	t.Helper()
	cl := &countingListener{Listener: ln}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") }), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(cl) }()
	t.Cleanup(func() { _ = srv.Close() })
	return cl
}

// run runs a command the test needs (ip), failing the test on error.
func run(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// privateNetns creates a network namespace joined to this one by a veth
// pair: the host side has <prefix>.1/30, the namespace <prefix>.2/30. It
// returns both addresses and the namespace's path. Nothing it carries can
// leave the machine.
func privateNetns(t *testing.T) (host, inside netip.Addr, nsPath string) {
	t.Helper()
	testgate.Need(t, os.Geteuid() == 0, "network namespaces need root")
	ipBin := testgate.NeedBinary(t, "ip", "install iproute2")
	var r [3]byte
	if _, err := rand.Read(r[:]); err != nil {
		t.Fatal(err)
	}
	tag := hex.EncodeToString(r[:])
	ns, hostIf, nsIf := "pf-egress-"+tag, "pfeh"+tag, "pfen"+tag
	// 10.213.N.0/30: inside the private range the policy refuses.
	third := int(r[0])
	host = netip.AddrFrom4([4]byte{10, 213, byte(third), 1})
	inside = netip.AddrFrom4([4]byte{10, 213, byte(third), 2})
	run(t, ipBin, "netns", "add", ns)
	t.Cleanup(func() { _ = exec.Command(ipBin, "netns", "del", ns).Run() })
	run(t, ipBin, "link", "add", hostIf, "type", "veth", "peer", "name", nsIf, "netns", ns)
	t.Cleanup(func() { _ = exec.Command(ipBin, "link", "del", hostIf).Run() })
	run(t, ipBin, "addr", "add", host.String()+"/30", "dev", hostIf)
	run(t, ipBin, "link", "set", hostIf, "up")
	run(t, ipBin, "-n", ns, "addr", "add", inside.String()+"/30", "dev", nsIf)
	run(t, ipBin, "-n", ns, "link", "set", nsIf, "up")
	run(t, ipBin, "-n", ns, "link", "set", "lo", "up")
	return host, inside, "/var/run/netns/" + ns
}

// listenIn opens a TCP listener on addr inside the network namespace at
// nsPath. The socket keeps its namespace; the thread that entered it dies
// with its goroutine.
func listenIn(t *testing.T, nsPath, addr string) net.Listener {
	t.Helper()
	type result struct {
		ln  net.Listener
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		fd, err := unix.Open(nsPath, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			ch <- result{err: err}
			return
		}
		defer unix.Close(fd)
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			ch <- result{err: fmt.Errorf("setns: %w", err)}
			return
		}
		ln, err := net.Listen("tcp", addr)
		ch <- result{ln, err}
	}()
	res := <-ch
	if res.err != nil {
		t.Fatalf("listen on %s in %s: %v", addr, nsPath, res.err)
	}
	t.Cleanup(func() { res.ln.Close() })
	return res.ln
}

// viaProxy sends one request line through the proxy at proxyAddr: CONNECT
// host:port, or GET of an absolute URI. It returns the status, the
// X-Squid-Error header and how long the answer took.
func viaProxy(t *testing.T, proxyAddr, method, target string) (int, string, time.Duration) {
	t.Helper()
	c, err := net.DialTimeout("tcp", proxyAddr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	host := target
	if strings.HasPrefix(target, "http://") {
		host = strings.SplitN(strings.TrimPrefix(target, "http://"), "/", 2)[0]
	}
	start := time.Now()
	if _, err := io.WriteString(c, method+" "+target+" HTTP/1.1\r\nHost: "+host+"\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: method})
	if err != nil {
		t.Fatalf("%s %s via %s: %v", method, target, proxyAddr, err)
	}
	if method != http.MethodConnect || resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	}
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("X-Squid-Error"), time.Since(start)
}

func wantSquidDenied(t *testing.T, proxyAddr, method, target string, rule egress.Rule) {
	t.Helper()
	code, squidErr, took := viaProxy(t, proxyAddr, method, target)
	if code != http.StatusForbidden || !strings.Contains(squidErr, egress.SquidPage(rule)) {
		t.Errorf("%s %s: %d %q, want 403 naming %s", method, target, code, squidErr, egress.SquidPage(rule))
	}
	if took > 3*time.Second {
		t.Errorf("%s %s: refused after %v, want at once", method, target, took)
	}
}

func wantSquidOK(t *testing.T, proxyAddr, method, target string) {
	t.Helper()
	if code, squidErr, _ := viaProxy(t, proxyAddr, method, target); code != http.StatusOK {
		t.Errorf("%s %s: %d %q, want 200", method, target, code, squidErr)
	}
}

// TestSquidEgress runs real Squid processes with the configuration the
// local agent generates: loopback, the host's own address and a private
// address inside a network namespace the test creates are refused at once
// with 403 naming the rule, and their listeners never see a connection; the
// echo endpoint and a pool's allowance are reached.
func TestSquidEgress(t *testing.T) {
	d := squidDriver(t, Config{})
	hostAddr, nsAddr, nsPath := privateNetns(t)
	inNS := serveCounting(t, listenIn(t, nsPath, net.JoinHostPort(nsAddr.String(), "0")))
	nsTarget := inNS.Addr().String()
	// The namespace is reachable: the refusals below are the policy's.
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get("http://" + nsTarget + "/")
	if err != nil {
		t.Fatalf("direct GET of %s: %v", nsTarget, err)
	}
	resp.Body.Close()
	nsBefore := inNS.accepted.Load()
	hostLn, err := net.Listen("tcp", net.JoinHostPort(hostAddr.String(), "0"))
	if err != nil {
		t.Fatal(err)
	}
	own := serveCounting(t, hostLn)
	loop := serveCounting(t, func() net.Listener {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return ln
	}())
	echo := origin(t)
	ctx := ctxT(t)
	port := func(addr string) int {
		_, p, _ := net.SplitHostPort(addr)
		n, _ := strconv.Atoi(p)
		return n
	}

	// The default policy with the echo endpoint allowed (the agent's
	// --egress-allow).
	sp := spec("demo-egress1")
	sp.Egress = allowing(t, echo)
	def, err := d.Create(ctx, sp)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	if err := squidtest.Parse(d.cfg.Squid, filepath.Join(d.states.instanceDir(sp.Name), fileSquid)); err != nil {
		t.Fatal(err)
	}
	wantSquidOK(t, def.Address, http.MethodGet, echo.URL+"/probe")
	wantSquidOK(t, def.Address, http.MethodConnect, echo.Listener.Addr().String())
	wantSquidDenied(t, def.Address, http.MethodConnect, loop.Addr().String(), egress.RulePort)
	wantSquidDenied(t, def.Address, http.MethodGet, "http://"+loop.Addr().String()+"/", egress.RulePort)
	wantSquidDenied(t, def.Address, http.MethodGet, "http://"+nsTarget+"/", egress.RulePort)

	// The ports allowed, the addresses are refused for their ranges.
	sp2 := spec("demo-egress2")
	pol, err := egress.Compile(nil, []int{port(loop.Addr().String()), port(nsTarget), port(own.Addr().String())}, sp.Egress.AllowEndpoints)
	if err != nil {
		t.Fatal(err)
	}
	sp2.Egress = pol
	ports, err := d.Create(ctx, sp2)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	if err := squidtest.Parse(d.cfg.Squid, filepath.Join(d.states.instanceDir(sp2.Name), fileSquid)); err != nil {
		t.Fatal(err)
	}
	wantSquidDenied(t, ports.Address, http.MethodConnect, loop.Addr().String(), egress.RuleLoopback)
	wantSquidDenied(t, ports.Address, http.MethodGet, "http://"+loop.Addr().String()+"/", egress.RuleLoopback)
	wantSquidDenied(t, ports.Address, http.MethodConnect, nsTarget, egress.RulePrivate)
	wantSquidDenied(t, ports.Address, http.MethodGet, "http://"+nsTarget+"/", egress.RulePrivate)

	// A pool allowing the namespace's range reaches it, but never the
	// host's own address inside that range.
	sp3 := spec("demo-egress3")
	pol.AllowCIDRs = []netip.Prefix{netip.PrefixFrom(hostAddr, 30).Masked()}
	sp3.Egress = pol
	allowed, err := d.Create(ctx, sp3)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	wantSquidOK(t, allowed.Address, http.MethodGet, "http://"+nsTarget+"/")
	if got := inNS.accepted.Load(); got != nsBefore+1 {
		t.Errorf("the namespace's server saw %d connections through squid, want exactly the allowed one", got-nsBefore)
	}
	wantSquidDenied(t, allowed.Address, http.MethodGet, "http://"+own.Addr().String()+"/", egress.RuleOwnAddress)
	wantSquidDenied(t, allowed.Address, http.MethodConnect, own.Addr().String(), egress.RuleOwnAddress)

	if n := loop.accepted.Load(); n != 0 {
		t.Errorf("the loopback listener saw %d connections, want none", n)
	}
	if n := own.accepted.Load(); n != 0 {
		t.Errorf("the listener on the host's own %s saw %d connections, want none", hostAddr, n)
	}
}

// TestSquidHostItselfWhateverTheAllowance runs real Squid with a pool that
// allows every range (0.0.0.0/0 and ::/0, as recorded before validation
// refused them): CONNECT 0.0.0.0:P (delivered by the kernel to a loopback
// listener), a GET to 127.0.0.2 and the IPv6 forms carrying loopback are
// refused at once naming the rule while the listeners see no connection;
// and the client's Forwarded, Via and X-Forwarded-* never reach the origin.
func TestSquidHostItselfWhateverTheAllowance(t *testing.T) {
	d := squidDriver(t, Config{})
	listen := func(addr string) *countingListener {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		return serveCounting(t, ln)
	}
	loop, loop2 := listen("127.0.0.1:0"), listen("127.0.0.2:0")
	_, p1, _ := net.SplitHostPort(loop.Addr().String())
	_, p2, _ := net.SplitHostPort(loop2.Addr().String())
	n1, _ := strconv.Atoi(p1)
	n2, _ := strconv.Atoi(p2)
	seen := make(chan http.Header, 1)
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case seen <- r.Header.Clone():
		default:
		}
		_, _ = io.WriteString(w, "ok")
	}))
	t.Cleanup(echo.Close)
	pol, err := egress.Compile([]string{"0.0.0.0/0", "::/0"}, []int{n1, n2}, []netip.AddrPort{endpoint(t, echo)})
	if err != nil {
		t.Fatal(err)
	}
	sp := spec("demo-host-itself")
	sp.Egress = pol
	inst, err := d.Create(ctxT(t), sp)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	if err := squidtest.Parse(d.cfg.Squid, filepath.Join(d.states.instanceDir(sp.Name), fileSquid)); err != nil {
		t.Fatal(err)
	}
	wantSquidDenied(t, inst.Address, http.MethodConnect, "0.0.0.0:"+p1, egress.RuleUnspecified)
	wantSquidDenied(t, inst.Address, http.MethodGet, "http://0.0.0.0:"+p1+"/", egress.RuleUnspecified)
	wantSquidDenied(t, inst.Address, http.MethodConnect, "127.0.0.1:"+p1, egress.RuleLoopback)
	wantSquidDenied(t, inst.Address, http.MethodConnect, "[::ffff:127.0.0.1]:"+p1, egress.RuleLoopback)
	wantSquidDenied(t, inst.Address, http.MethodConnect, "[64:ff9b::7f00:1]:"+p1, egress.RuleLoopback)
	wantSquidDenied(t, inst.Address, http.MethodConnect, "[::7f00:1]:"+p1, egress.RuleLoopback)
	wantSquidDenied(t, inst.Address, http.MethodGet, "http://127.0.0.2:"+p2+"/", egress.RuleLoopback)
	wantSquidDenied(t, inst.Address, http.MethodConnect, "127.0.0.2:"+p2, egress.RuleLoopback)
	if n := loop.accepted.Load(); n != 0 {
		t.Errorf("the listener on %s saw %d connections through squid, want none", loop.Addr(), n)
	}
	if n := loop2.accepted.Load(); n != 0 {
		t.Errorf("the listener on %s saw %d connections through squid, want none", loop2.Addr(), n)
	}

	req, err := http.NewRequest(http.MethodGet, echo.URL+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Forwarded", "for=10.9.8.7;by=crawler")
	req.Header.Set("Via", "1.1 crawler-internal")
	req.Header.Set("X-Forwarded-For", "10.9.8.7")
	req.Header.Set("X-Forwarded-Host", "crawler.internal")
	req.Header.Set("X-Forwarded-Proto", "https")
	req.Header.Set("X-Kept", "yes")
	client := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: inst.Address})}, Timeout: 20 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET the echo endpoint through squid: %d, want 200", resp.StatusCode)
	}
	got := <-seen
	for _, h := range egress.ClientHeaders {
		if v := got.Values(h); len(v) > 0 {
			t.Errorf("the origin saw %s: %q", h, v)
		}
	}
	if got.Get("X-Kept") != "yes" {
		t.Errorf("the origin saw %v; other headers must pass", got)
	}
}
