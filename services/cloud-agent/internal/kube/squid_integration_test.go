//go:build integration

package kube

import (
	"bufio"
	"encoding/base64"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/htpasswd"
	"proxyfleet/pkg/testgate"
)

// podRootScript runs squid as the Pod would: in new mount and network
// namespaces, chrooted into a copy-on-write view of the host's root that is
// then made read-only, with the Pod's Secret mounted at configDir and a
// tmpfs at each emptyDir mount point, as the Pod's numeric user with no
// privileges. Arguments: work dir, uid, squid, then the emptyDir paths.
const podRootScript = `set -e
work=$1 uid=$2 squid=$3; shift 3
mount --make-rprivate /
mkdir -p "$work/upper" "$work/root"
mount -t tmpfs tmpfs "$work/upper"
mkdir "$work/upper/u" "$work/upper/w"
mount -t overlay overlay -o "lowerdir=/,upperdir=$work/upper/u,workdir=$work/upper/w" "$work/root"
root=$work/root
mkdir -p "$root` + configDir + `"
mount --bind "$work/secret" "$root` + configDir + `"
for d in "$@"; do mkdir -p "$root$d"; mount -t tmpfs -o mode=1777,size=64m tmpfs "$root$d"; done
mount --rbind /dev "$root/dev"
mount -t proc proc "$root/proc"
mount -o remount,ro "$root"
ip link set lo up
exec chroot "$root" setpriv --reuid="$uid" --regid="$uid" --clear-groups --no-new-privs "$squid" -N -f ` + configDir + "/" + squidConfKey + "\n"

// TestSquidPodRunsReadOnly runs Debian's squid with the Secret and the
// volumes of the Pod the driver builds: its configuration and bcrypt
// htpasswd line, a read-only root with the emptyDirs as the only writable
// places, its numeric non-root user. Without credentials or with a wrong
// password the proxy answers 407; with the pool's, it does not.
func TestSquidPodRunsReadOnly(t *testing.T) {
	testgate.Need(t, os.Geteuid() == 0, "root, for mount and network namespaces")
	squid := os.Getenv("PROXYFLEET_SQUID")
	if squid == "" {
		squid = "/usr/sbin/squid"
	}
	testgate.NeedFile(t, squid, "Debian's squid (make squid-install)")
	for _, bin := range []string{"unshare", "chroot", "setpriv", "ip", "mount"} {
		testgate.NeedBinary(t, bin, bin+" (util-linux, iproute2)")
	}
	helper := filepath.Join(filepath.Dir(filepath.Dir(squid)), "lib", "squid", "basic_ncsa_auth")

	const port = 3128 // inside the test's own network namespace
	spec := agent.Spec{ProxyID: "pool-k-ro", Pool: "pool-k", Entry: "k8s", Name: "px-ro", Port: port,
		Auth: &events.ProxyAuth{Username: "crawler", Password: "ro-pässword"}}
	d := New(nil, Options{Entry: "k8s", Namespace: "ns"})
	pod, err := d.podFor(spec)
	must(t, err)
	uid := *pod.Spec.SecurityContext.RunAsUser
	emptyDirs := map[string]bool{}
	for _, v := range pod.Spec.Volumes {
		if v.EmptyDir != nil {
			emptyDirs[v.Name] = true
		}
	}
	var writable []string
	for _, m := range pod.Spec.Containers[0].VolumeMounts {
		if emptyDirs[m.Name] {
			writable = append(writable, m.MountPath)
		}
	}

	work := t.TempDir()
	secret := filepath.Join(work, "secret")
	must(t, os.Mkdir(secret, 0o755))
	line, err := htpasswd.Line(spec.Auth.Username, spec.Auth.Password)
	must(t, err)
	// The requests below go to 127.0.0.1:1, which the egress policy refuses
	// unless allowed as an endpoint: allowing it lets them reach authentication.
	askable := egress.Policy{AllowEndpoints: []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:1")}}
	// The Pod's host name resolves (the kubelet's /etc/hosts); here the
	// host's, which the chroot's /etc/hosts maps.
	podHost, err := os.Hostname()
	must(t, err)
	for name, content := range map[string]string{squidConfKey: squidConf(podHost, port, spec.Auth, helper, askable), htpasswdKey: line} {
		must(t, os.WriteFile(filepath.Join(secret, name), []byte(content), 0o444))
	}
	// The container's stdout and stderr belong to its user, as the
	// container runtime hands them over: squid reopens /dev/stdout.
	r, w, err := os.Pipe()
	must(t, err)
	must(t, unix.Fchown(int(w.Fd()), int(uid), int(uid)))
	var out strings.Builder
	var outMu sync.Mutex
	go func() {
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			outMu.Lock()
			out.WriteString(sc.Text() + "\n")
			outMu.Unlock()
		}
	}()
	logs := func() string { outMu.Lock(); defer outMu.Unlock(); return out.String() }
	args := append([]string{"--mount", "--net", "sh", "-c", podRootScript, "sh", work, strconv.FormatInt(uid, 10), squid}, writable...)
	cmd := exec.Command("unshare", args...)
	cmd.Stdout, cmd.Stderr = w, w
	// The parent-death signal follows the thread that started the child:
	// start it from a thread locked until the child ends.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	started, exited := make(chan error, 1), make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		exited <- cmd.Wait()
	}()
	must(t, <-started)
	w.Close()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})

	ask := func(user, password string) (string, error) {
		conn, err := dialInNetns(cmd.Process.Pid, fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			return "", err
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		req := "GET http://127.0.0.1:1/ HTTP/1.1\r\nHost: 127.0.0.1:1\r\nConnection: close\r\n"
		if user != "" {
			req += "Proxy-Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password)) + "\r\n"
		}
		if _, err := conn.Write([]byte(req + "\r\n")); err != nil {
			return "", err
		}
		status, err := bufio.NewReader(conn).ReadString('\n')
		return strings.TrimSpace(status), err
	}
	var status string
	if err := poll(30*time.Second, func() error {
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("squid's namespace ended: %v\n%s", err, logs())
		default:
		}
		status, err = ask("", "")
		return err
	}); err != nil || !strings.Contains(status, " 407 ") {
		t.Fatalf("without credentials: %q, %v; want 407\n%s", status, err, logs())
	}
	if status, err := ask("crawler", "ro-pässwort"); err != nil || !strings.Contains(status, " 407 ") {
		t.Errorf("wrong password: %q, %v; want 407\n%s", status, err, logs())
	}
	if status, err := ask("crawler", "ro-pässword"); err != nil || strings.Contains(status, " 407 ") || !strings.HasPrefix(status, "HTTP/1.1 ") {
		t.Errorf("the pool's credentials: %q, %v; want an answer past authentication\n%s", status, err, logs())
	}
	if l := logs(); strings.Contains(l, "FATAL") || strings.Contains(l, "Read-only file system") {
		t.Errorf("squid complained:\n%s", l)
	}
}

// dialInNetns connects to addr from inside the network namespace of pid:
// the socket is made on a thread moved into that namespace and back. The
// thread must not be discarded: the control plane's processes get SIGKILL
// when the thread that started them exits (Pdeathsig), and any thread may
// be that one.
func dialInNetns(pid int, addr string) (net.Conn, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	home, err := os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
	if err != nil {
		return nil, err
	}
	defer home.Close()
	target, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", pid))
	if err != nil {
		return nil, err
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		return nil, fmt.Errorf("setns: %w", err)
	}
	conn, dialErr := net.DialTimeout("tcp", addr, 5*time.Second)
	if err := unix.Setns(int(home.Fd()), unix.CLONE_NEWNET); err != nil {
		panic("cannot return the thread to the test's network namespace: " + err.Error())
	}
	return conn, dialErr
}
