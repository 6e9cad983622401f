package seal_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"proxyfleet/pkg/seal"
)

func TestSealOpenRoundTrip(t *testing.T) {
	kp, err := seal.NewKey()
	if err != nil {
		t.Fatal(err)
	}
	plain := []byte("hunter2-password")
	s, err := seal.Seal(plain, seal.Public(kp))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(s.Box, plain) {
		t.Fatal("the box holds the plaintext")
	}
	got, err := seal.Open(kp, s)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, plain) {
		t.Fatalf("opened %q, want %q", got, plain)
	}
}

func TestOpenWithAnotherKeyFails(t *testing.T) {
	a, _ := seal.NewKey()
	b, _ := seal.NewKey()
	s, err := seal.Seal([]byte("secret-bytes"), seal.Public(a))
	if err != nil {
		t.Fatal(err)
	}
	_, err = seal.Open(b, s)
	if !errors.Is(err, seal.ErrWrongKey) {
		t.Fatalf("err = %v, want ErrWrongKey", err)
	}
	if strings.Contains(err.Error(), "secret-bytes") {
		t.Fatalf("error quotes the plaintext: %v", err)
	}
	// A box relabelled for b still does not open with b.
	s.To = seal.Public(b)
	if _, err := seal.Open(b, s); err == nil || errors.Is(err, seal.ErrWrongKey) {
		t.Fatalf("relabelled box: err = %v, want a failure to open", err)
	}
}

func TestSealRefusesABadRecipient(t *testing.T) {
	user, _ := seal.NewKey()
	if _, err := seal.Seal([]byte("x"), "UABC"); err == nil {
		t.Fatal("sealed to a non-curve key")
	}
	_ = user
}

func TestLoadOrCreateKeepsTheKey(t *testing.T) {
	path := filepath.Join(t.TempDir(), "keys", "agent.xk")
	kp, err := seal.LoadOrCreate(path)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file mode %04o, want 0600", fi.Mode().Perm())
	}
	again, err := seal.LoadOrCreate(path)
	if err != nil {
		t.Fatal(err)
	}
	if seal.Public(again) != seal.Public(kp) {
		t.Fatal("a second load made a new key")
	}
	s, _ := seal.Seal([]byte("queued"), seal.Public(kp))
	if got, err := seal.Open(again, s); err != nil || string(got) != "queued" {
		t.Fatalf("reloaded key opens %q, %v", got, err)
	}
}

func TestLoadOrCreateConcurrentStartsAgree(t *testing.T) {
	path := filepath.Join(t.TempDir(), "k.xk")
	pubs := make([]string, 8)
	var wg sync.WaitGroup
	for i := range pubs {
		wg.Go(func() {
			kp, err := seal.LoadOrCreate(path)
			if err != nil {
				t.Error(err)
				return
			}
			pubs[i] = seal.Public(kp)
		})
	}
	wg.Wait()
	for _, p := range pubs {
		if p != pubs[0] {
			t.Fatalf("concurrent starts got different keys: %v", pubs)
		}
	}
}

func TestLoadRefusesOpenModesAndOtherContent(t *testing.T) {
	dir := t.TempDir()
	kp, _ := seal.NewKey()
	seed, _ := kp.Seed()
	loose := filepath.Join(dir, "loose.xk")
	if err := os.WriteFile(loose, seed, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := seal.Load(loose); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Fatalf("mode 0644: err = %v", err)
	}
	junk := filepath.Join(dir, "junk.xk")
	if err := os.WriteFile(junk, []byte("SUNOTACURVESEEDATALL"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := seal.Load(junk)
	if err == nil || strings.Contains(err.Error(), "SUNOTACURVE") {
		t.Fatalf("junk: err = %v (must fail without quoting the file)", err)
	}
}
