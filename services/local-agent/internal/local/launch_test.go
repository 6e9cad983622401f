package local

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSearchable(t *testing.T) {
	base := t.TempDir()
	open := filepath.Join(base, "open", "state")
	closed := filepath.Join(base, "closed", "state")
	for _, d := range []string{open, closed} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		dir  string
		mode os.FileMode
	}{{base, 0o755}, {filepath.Dir(base), 0o755}, {filepath.Dir(closed), 0o750}} {
		if err := os.Chmod(c.dir, c.mode); err != nil {
			t.Fatal(err)
		}
	}
	const stranger = 54321 // neither owner nor group of the test's files
	if err := searchable(open, stranger, stranger); err != nil {
		t.Errorf("searchable(%s) = %v, want nil", open, err)
	}
	err := searchable(closed, stranger, stranger)
	if err == nil || !strings.Contains(err.Error(), filepath.Dir(closed)) {
		t.Errorf("searchable(%s) = %v, want an error naming %s", closed, err, filepath.Dir(closed))
	}
}

func TestSquidConfig(t *testing.T) {
	c := squidConf{Name: "px-a", Dir: "/s/px-a", Listen: "127.0.0.1:20001", SourceAddr: "192.0.2.7",
		Helper: "/usr/lib/squid/basic_ncsa_auth", Htpasswd: "/s/px-a/htpasswd", User: "proxy"}
	got := c.render()
	for _, want := range []string{
		"http_port 127.0.0.1:20001\n",
		"tcp_outgoing_address 192.0.2.7\n",
		"auth_param basic program /usr/lib/squid/basic_ncsa_auth /s/px-a/htpasswd\n",
		"http_access allow authenticated\nhttp_access deny all\n",
		"cache_effective_user proxy\n",
		"pid_filename /s/px-a/squid.pid\n",
		"via off\nforwarded_for delete\n",
		"request_header_access Forwarded deny all\n",
		"request_header_access Via deny all\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("squid.conf lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "cache_dir") || strings.Contains(got, "allow all") {
		t.Errorf("squid.conf with auth has a cache_dir or allows all:\n%s", got)
	}
	open := squidConf{Name: "px-b", Dir: "/s/px-b", Listen: "127.0.0.1:20002"}.render()
	if !strings.Contains(open, "http_access allow all\n") || strings.Contains(open, "auth_param") || strings.Contains(open, "tcp_outgoing_address") {
		t.Errorf("squid.conf without auth or source:\n%s", open)
	}
}
