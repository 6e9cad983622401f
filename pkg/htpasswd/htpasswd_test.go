package htpasswd

import (
	"strings"
	"testing"
)

func TestLineVerifies(t *testing.T) {
	// Each bcrypt costs tens of milliseconds (seconds under -race): few cases.
	for _, pw := range []string{"with spaces : and pässwörd-ü", strings.Repeat("x", MaxPasswordBytes)} {
		line, err := Line("crawler", pw)
		if err != nil {
			t.Fatalf("Line(%q): %v", pw, err)
		}
		if !strings.HasPrefix(line, "crawler:$2y$10$") || !strings.HasSuffix(line, "\n") || strings.Count(line, "\n") != 1 {
			t.Fatalf("Line = %q, want crawler:$2y$10$...\\n", line)
		}
		if strings.Contains(line, pw) {
			t.Fatalf("line %q holds the password", line)
		}
		if !Verify([]byte(line), "crawler", pw) {
			t.Errorf("Verify(Line(%q)) = false", pw)
		}
		// The longer password is refused before bcrypt, which would ignore its 73rd byte.
		if Verify([]byte(line), "crawler", pw[:len(pw)-1]) || Verify([]byte(line), "crawler", pw+"x") || Verify([]byte(line), "other", pw) {
			t.Errorf("Verify accepts a wrong password or user for %q", pw)
		}
	}
}

func TestHashIsSalted(t *testing.T) {
	a, err := Hash("same")
	if err != nil {
		t.Fatal(err)
	}
	b, err := Hash("same")
	if err != nil {
		t.Fatal(err)
	}
	if a == b {
		t.Fatalf("two hashes of one password are equal: %s", a)
	}
}

// TestVerifyHtpasswdOutput checks lines written by `htpasswd -nbB` (Apache
// 2.4) verify, among lines of other users and formats.
func TestVerifyHtpasswdOutput(t *testing.T) {
	file := "alice:$apr1$abcdefgh$aJUuGLjz3OI4ylHF//t5U1\n" +
		"u:$2y$05$SgZHoqzIHtYYHdSetIETRu/lHjHAPLA31Qcx5qDem0Ytb8XeWOP86\n"
	if !Verify([]byte(file), "u", "pw") {
		t.Error("htpasswd's bcrypt line for u/pw does not verify")
	}
	if Verify([]byte(file), "u", "pW") {
		t.Error("a wrong password verifies")
	}
	if Verify([]byte(file), "alice", "p@ss word") {
		t.Error("an MD5 entry verifies; only bcrypt is accepted")
	}
}

func TestRefusals(t *testing.T) {
	cases := []struct {
		user, pw, want string
	}{
		{"", "pw", "empty user name"},
		{"a:b", "pw", "contains ':'"},
		{"a\nb", "pw", "line break"},
		{"u", "", "empty password"},
		{"u", "p\nw", "line break"},
		{"u", strings.Repeat("y", MaxPasswordBytes+1), "73 bytes long; bcrypt takes at most 72"},
	}
	for _, c := range cases {
		_, err := Line(c.user, c.pw)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Line(%q, %q) error = %v, want %q", c.user, c.pw, err, c.want)
		}
		if err != nil && c.pw != "" && strings.Contains(err.Error(), c.pw) {
			t.Errorf("error %q holds the password", err)
		}
	}
}
