package clients

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/htpasswd"
)

func line(t *testing.T, user, password string) string {
	t.Helper()
	l, err := htpasswd.Line(user, password)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestFileAllowsThePoolsPasswordsAndRereadsChanges(t *testing.T) {
	path := filepath.Join(t.TempDir(), "clients")
	if err := os.WriteFile(path, []byte("# crawler teams\n"+line(t, "demo", "demo-secret-1")+line(t, "*", "admin-secret-1")), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		pool, password string
		want           bool
	}{
		{"demo", "demo-secret-1", true},
		{"demo", "demo-secret-1", true}, // remembered
		{"demo", "wrong", false},
		{"other", "demo-secret-1", false},
		{"other", "admin-secret-1", true},
		{"demo", "admin-secret-1", true},
	} {
		if got := f.Allow(c.pool, c.password); got != c.want {
			t.Errorf("Allow(%q, %q) = %v; want %v", c.pool, c.password, got, c.want)
		}
	}
	// A new file (another modification time) replaces the old one, and
	// what was remembered of it.
	if err := os.WriteFile(path, []byte(line(t, "demo", "demo-secret-2")), 0o600); err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(time.Hour)
	if err := os.Chtimes(path, later, later); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for f.Allow("demo", "demo-secret-1") {
		if time.Now().After(deadline) {
			t.Fatal("the old password still opens the pool 10s after the file changed")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !f.Allow("demo", "demo-secret-2") || f.Allow("other", "admin-secret-1") {
		t.Error("after the change: want only demo's new password to open")
	}
}

func TestLoadRefusesWhatIsNotABcryptFile(t *testing.T) {
	dir := t.TempDir()
	for name, c := range map[string]struct{ body, says string }{
		"empty":    {"# nothing\n", "no entries"},
		"plain":    {"demo:secret\n", "line 1: want <pool or *>:<bcrypt hash>"},
		"no colon": {"demo\n", "line 1"},
	} {
		path := filepath.Join(dir, strings.ReplaceAll(name, " ", "-"))
		if err := os.WriteFile(path, []byte(c.body), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := Load(path); err == nil || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: Load: %v; want an error saying %q", name, err, c.says)
		}
	}
	if _, err := Load(filepath.Join(dir, "missing")); err == nil {
		t.Error("Load of a missing file: no error")
	}
}
