package clients

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"

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

// cheapLine is an htpasswd line at bcrypt's least cost, for tests that
// make many checks.
func cheapLine(t *testing.T, user, password string) string {
	t.Helper()
	h, err := bcrypt.GenerateFromPassword([]byte(password), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	return user + ":" + string(h) + "\n"
}

func TestFileAllowsThePoolsPasswordsAndRereadsChanges(t *testing.T) {
	path := filepath.Join(t.TempDir(), "clients")
	if err := os.WriteFile(path, []byte("# crawler teams\n"+line(t, "demo", "demo-secret-1")+line(t, "*", "admin-secret-1")), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := Load(path, Limits{})
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
		if got, err := f.Allow("127.0.0.1", c.pool, c.password); got != c.want || err != nil {
			t.Errorf("Allow(%q, %q) = %v, %v; want %v", c.pool, c.password, got, err, c.want)
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
	for ok, _ := f.Allow("127.0.0.1", "demo", "demo-secret-1"); ok; ok, _ = f.Allow("127.0.0.1", "demo", "demo-secret-1") {
		if time.Now().After(deadline) {
			t.Fatal("the old password still opens the pool 10s after the file changed")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if ok, _ := f.Allow("127.0.0.1", "demo", "demo-secret-2"); !ok {
		t.Error("after the change: demo's new password does not open it")
	}
	if ok, _ := f.Allow("127.0.0.1", "other", "admin-secret-1"); ok {
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
		if _, err := Load(path, Limits{}); err == nil || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: Load: %v; want an error saying %q", name, err, c.says)
		}
	}
	if _, err := Load(filepath.Join(dir, "missing"), Limits{}); err == nil {
		t.Error("Load of a missing file: no error")
	}
}

// TestFailedLoginsAreThrottledAndVerdictsCached: wrong passwords from one
// address cost at most its burst of checks (two bcrypts each with a "*"
// line), then are refused unchecked with a time to retry; another address
// is unaffected; a verdict once reached costs no bcrypt, right or wrong;
// and a changed file forgets them.
func TestFailedLoginsAreThrottledAndVerdictsCached(t *testing.T) {
	path := filepath.Join(t.TempDir(), "clients")
	if err := os.WriteFile(path, []byte(cheapLine(t, "demo", "demo-secret-1")+cheapLine(t, "*", "admin-secret-1")), 0o600); err != nil {
		t.Fatal(err)
	}
	const burst = 3
	f, err := Load(path, Limits{FailureBurst: burst, FailureEvery: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	var bcrypts atomic.Int32
	f.verify = func(file []byte, user, password string) bool {
		if strings.Contains(string(file), user+":") {
			bcrypts.Add(1)
		}
		return htpasswd.Verify(file, user, password)
	}
	allow := func(client, pool, password string) (bool, error) {
		t.Helper()
		return f.Allow(client, pool, password)
	}
	attacker, other := "192.0.2.7", "192.0.2.8"
	for i := range 10 {
		ok, err := allow(attacker, "demo", fmt.Sprintf("guess-%d", i))
		var th *Throttled
		switch {
		case ok:
			t.Fatalf("guess %d opened the pool", i)
		case i < burst && err != nil:
			t.Fatalf("failed login %d of %d: %v; want a plain refusal", i+1, burst, err)
		case i >= burst && (!errors.As(err, &th) || th.RetryAfter() <= 0 || th.RetryAfter() > time.Hour):
			t.Fatalf("failed login %d past a burst of %d: %v; want *Throttled with a retry within the hour", i+1, burst, err)
		}
	}
	if n := bcrypts.Load(); n > 2*burst {
		t.Fatalf("10 failed logins cost %d bcrypts; want at most %d", n, 2*burst)
	}
	if ok, err := allow(attacker, "demo", "guess-0"); ok || err != nil {
		t.Errorf("a remembered wrong password from a throttled address: %v, %v; want a plain refusal", ok, err)
	}
	before := bcrypts.Load()
	if ok, err := allow(other, "demo", "demo-secret-1"); !ok || err != nil {
		t.Fatalf("another address with the right password: %v, %v", ok, err)
	}
	if ok, err := allow(other, "demo", "wrong"); ok || err != nil {
		t.Fatalf("another address with a wrong password: %v, %v; want a plain refusal", ok, err)
	}
	// Remembered: the right password opens the pool even from the
	// throttled address, and neither verdict costs a bcrypt again.
	for range 5 {
		if ok, err := allow(attacker, "demo", "demo-secret-1"); !ok || err != nil {
			t.Fatalf("the remembered right password from the throttled address: %v, %v", ok, err)
		}
		if ok, _ := allow(other, "demo", "wrong"); ok {
			t.Fatal("a remembered wrong password opened the pool")
		}
	}
	if n := bcrypts.Load() - before; n != 3 { // demo-secret-1: 1; wrong: demo and *
		t.Errorf("the two new verdicts and their repeats cost %d bcrypts; want 3", n)
	}
	// The file changes: what was remembered of the old one goes.
	if err := os.WriteFile(path, []byte(cheapLine(t, "demo", "demo-secret-2")), 0o600); err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(time.Hour)
	if err := os.Chtimes(path, later, later); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	f.checked = time.Time{} // read the file again at the next call
	f.mu.Unlock()
	if ok, err := allow(other, "demo", "demo-secret-1"); ok || err != nil {
		t.Errorf("the old password after the file changed: %v, %v; want a plain refusal", ok, err)
	}
	if ok, err := allow(other, "demo", "demo-secret-2"); !ok || err != nil {
		t.Errorf("the new password: %v, %v", ok, err)
	}
}
