package local

import (
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/htpasswd"
)

// Files in an instance directory.
const (
	fileAuth     = "auth"     // built-in proxy: username:password
	fileHtpasswd = "htpasswd" // squid: username:bcrypt (pkg/htpasswd)
	fileSquid    = "squid.conf"
	fileLog      = "proxy.log" // the process's stdout and stderr
)

// prepare writes the instance's files for s (auth from the spec, squid
// config) and returns how to start its process. It runs before every start,
// so a restarted process gets the current spec's credentials.
func (d *Driver) prepare(s *state, auth *events.ProxyAuth, pol egress.Policy) (launch, error) {
	dir := d.states.instanceDir(s.Name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return launch{}, err
	}
	if auth != nil && (auth.Username == "" || strings.ContainsAny(auth.Username, ":\r\n") || strings.ContainsAny(auth.Password, "\r\n")) {
		return launch{}, agent.Wrapf(agent.ErrPermanent, "proxy auth: the username must be non-empty without ':' or line breaks, the password without line breaks")
	}
	l := launch{dir: dir, logPath: filepath.Join(dir, fileLog), statePath: d.states.path(s.Name)}
	if s.Mode == modeBuiltin {
		l.builtin = true
		l.argv = []string{d.cfg.Executable, "proxy", "--listen", s.address()}
		authPath := filepath.Join(dir, fileAuth)
		if auth != nil {
			if err := writeFileAtomic(authPath, []byte(auth.Username+":"+auth.Password+"\n"), 0o600); err != nil {
				return launch{}, err
			}
			l.argv = append(l.argv, "--auth-file", authPath)
		} else if err := os.Remove(authPath); err != nil && !os.IsNotExist(err) {
			return launch{}, err
		}
		if s.SourceAddr != "" {
			l.argv = append(l.argv, "--source-addr", s.SourceAddr)
		}
		l.argv = append(l.argv, egressArgs(pol)...)
		return l, nil
	}
	return d.prepareSquid(s, auth, pol, l)
}

// egressArgs are the "local-agent proxy" flags of pol's allowances (the
// proxy finds the host's own addresses itself).
func egressArgs(pol egress.Policy) []string {
	var args []string
	if len(pol.AllowEndpoints) > 0 {
		args = append(args, "--egress-allow", strings.Join(egress.FormatEndpoints(pol.AllowEndpoints), ","))
	}
	if len(pol.AllowCIDRs) > 0 {
		cidrs := make([]string, len(pol.AllowCIDRs))
		for i, c := range pol.AllowCIDRs {
			cidrs[i] = c.String()
		}
		args = append(args, "--egress-allow-cidrs", strings.Join(cidrs, ","))
	}
	if len(pol.AllowPorts) > 0 {
		ports := make([]string, len(pol.AllowPorts))
		for i, p := range pol.AllowPorts {
			ports[i] = strconv.Itoa(int(p))
		}
		args = append(args, "--egress-allow-ports", strings.Join(ports, ","))
	}
	return args
}

func (d *Driver) prepareSquid(s *state, auth *events.ProxyAuth, pol egress.Policy, l launch) (launch, error) {
	if own, err := egress.HostAddrs(); err == nil {
		pol.Own = own
	} else {
		return launch{}, fmt.Errorf("list this host's addresses for the egress policy: %w", err)
	}
	conf := squidConf{
		Name: s.Name, Dir: l.dir, Listen: s.address(), SourceAddr: s.SourceAddr, Egress: pol,
		Helper: filepath.Join(filepath.Dir(filepath.Dir(d.cfg.Squid)), "lib", "squid", "basic_ncsa_auth"),
	}
	// Started as root, squid drops to its effective user: that user must
	// own the files it writes (logs) and reads later (the htpasswd file,
	// read by the auth helper after the drop).
	owner := -1
	var gid int
	if os.Geteuid() == 0 {
		u, err := user.Lookup(d.cfg.squidUser())
		if err != nil {
			return launch{}, agent.Wrapf(agent.ErrPermanent, "squid user %q: %w", d.cfg.squidUser(), err)
		}
		owner, _ = strconv.Atoi(u.Uid)
		gid, _ = strconv.Atoi(u.Gid)
		conf.User = d.cfg.squidUser()
		if err := searchable(d.cfg.StateDir, owner, gid); err != nil {
			return launch{}, agent.Wrapf(agent.ErrPermanent, "squid drops to user %s, which cannot reach the state directory: %w; make it searchable (chmod o+x) or choose another --state-dir", conf.User, err)
		}
	}
	if auth != nil {
		line, err := htpasswd.Line(auth.Username, auth.Password)
		if err != nil {
			return launch{}, agent.Wrapf(agent.ErrPermanent, "basic auth of proxy %s: %w", s.Name, err)
		}
		conf.Htpasswd = filepath.Join(l.dir, fileHtpasswd)
		if err := writeFileAtomic(conf.Htpasswd, []byte(line), 0o600); err != nil {
			return launch{}, err
		}
	}
	confPath := filepath.Join(l.dir, fileSquid)
	if err := writeFileAtomic(confPath, []byte(conf.render()), 0o644); err != nil {
		return launch{}, err
	}
	if owner >= 0 {
		for _, p := range []string{l.dir, conf.Htpasswd, filepath.Join(l.dir, "cache.log"), filepath.Join(l.dir, "access.log")} {
			if p == "" {
				continue
			}
			if err := os.Lchown(p, owner, gid); err != nil && !os.IsNotExist(err) {
				return launch{}, err
			}
		}
	}
	l.argv = []string{d.cfg.Squid, "-N", "-f", confPath}
	return l, nil
}

// squidConf is a per-proxy squid.conf: no cache, files in the instance
// directory, basic auth when set.
type squidConf struct {
	Name, Dir, Listen, SourceAddr string
	Helper, Htpasswd              string
	User                          string // cache_effective_user, when root
	Egress                        egress.Policy
}

func (c squidConf) render() string {
	var b strings.Builder
	line := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	line("# proxyfleet local-agent: squid for %s; rewritten at every start", c.Name)
	line("http_port %s", c.Listen)
	line("pid_filename %s", filepath.Join(c.Dir, "squid.pid"))
	line("cache_log %s", filepath.Join(c.Dir, "cache.log"))
	line("access_log stdio:%s", filepath.Join(c.Dir, "access.log"))
	line("coredump_dir %s", c.Dir)
	line("netdb_filename none")
	line("logfile_rotate 0")
	line("pinger_enable off")
	line("cache deny all")
	line("cache_mem 8 MB")
	line("visible_hostname proxyfleet-%s", c.Name)
	b.WriteString(egress.SquidHideClient())
	b.WriteString(egress.SquidMarkOwnErrors())
	line("shutdown_lifetime 1 seconds")
	if c.User != "" {
		line("cache_effective_user %s", c.User)
	}
	if c.SourceAddr != "" {
		line("tcp_outgoing_address %s", c.SourceAddr)
	}
	// The egress denies come first: they hold for authenticated clients too.
	b.WriteString(c.Egress.SquidRules(egress.SquidOwn{}))
	if c.Htpasswd != "" {
		line("auth_param basic program %s %s", c.Helper, c.Htpasswd)
		line("auth_param basic children 2 startup=1 idle=1")
		line("auth_param basic realm proxyfleet")
		line("acl authenticated proxy_auth REQUIRED")
		line("http_access allow authenticated")
		line("http_access deny all")
	} else {
		line("http_access allow all")
	}
	return b.String()
}

// writeFileAtomic writes data to path through a temp file and a rename.
func writeFileAtomic(path string, data []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// searchable reports whether a process with uid and gid may traverse dir
// and each of its ancestors (the execute bit that applies to it).
func searchable(dir string, uid, gid int) error {
	for p := filepath.Clean(dir); ; p = filepath.Dir(p) {
		fi, err := os.Stat(p)
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		mode := fi.Mode().Perm()
		switch {
		case !ok:
		case int(st.Uid) == uid:
			if mode&0o100 == 0 {
				return fmt.Errorf("%s is not searchable by its owner", p)
			}
		case int(st.Gid) == gid:
			if mode&0o010 == 0 {
				return fmt.Errorf("%s (mode %#o) is not searchable by its group", p, mode)
			}
		case mode&0o001 == 0:
			return fmt.Errorf("%s (mode %#o) is not searchable by others", p, mode)
		}
		if p == filepath.Dir(p) {
			return nil
		}
	}
}
