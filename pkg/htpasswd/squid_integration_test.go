//go:build integration

package htpasswd

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"proxyfleet/pkg/testgate"
)

// ncsaAuth returns Debian's basic_ncsa_auth, next to the squid binary named
// by PROXYFLEET_SQUID (as `make test-squid` sets it), else /usr/sbin/squid.
func ncsaAuth(t *testing.T) string {
	t.Helper()
	squid := os.Getenv("PROXYFLEET_SQUID")
	if squid == "" {
		squid = "/usr/sbin/squid"
	}
	helper := filepath.Join(filepath.Dir(filepath.Dir(squid)), "lib", "squid", "basic_ncsa_auth")
	testgate.NeedFile(t, helper, "Debian's squid (make squid-install)")
	return helper
}

// helperEscape encodes s as Squid does in helper requests (RFC 1738
// escaping; basic_ncsa_auth unescapes user and password).
func helperEscape(s string) string {
	var b strings.Builder
	for _, c := range []byte(s) {
		if c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || strings.IndexByte("-_.", c) >= 0 {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// askHelper runs basic_ncsa_auth on file and returns its answer ("OK" or
// "ERR ...") to each "user password" request, in order.
func askHelper(t *testing.T, helper, file string, reqs [][2]string) []string {
	t.Helper()
	var in strings.Builder
	for _, r := range reqs {
		in.WriteString(helperEscape(r[0]) + " " + helperEscape(r[1]) + "\n")
	}
	cmd := exec.Command(helper, file)
	cmd.Stdin = strings.NewReader(in.String())
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v", helper, file, err)
	}
	var answers []string
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		answers = append(answers, strings.TrimSpace(sc.Text()))
	}
	if len(answers) != len(reqs) {
		t.Fatalf("%d answers to %d requests: %q", len(answers), len(reqs), out)
	}
	return answers
}

var passwords = []string{"sq-pass", "with spaces : and pässwörd-ü", strings.Repeat("L", MaxPasswordBytes)}

// TestNCSAAuthAcceptsOurLines runs Squid's basic_ncsa_auth on a file of
// Line's output: OK for each right password, ERR for wrong ones.
func TestNCSAAuthAcceptsOurLines(t *testing.T) {
	helper := ncsaAuth(t)
	var file strings.Builder
	var reqs [][2]string
	var want []string
	for i, pw := range passwords {
		user := fmt.Sprintf("crawler%d", i)
		line, err := Line(user, pw)
		if err != nil {
			t.Fatal(err)
		}
		file.WriteString(line)
		reqs = append(reqs, [2]string{user, pw}, [2]string{user, pw[:len(pw)-1] + "!"})
		want = append(want, "OK", "ERR")
	}
	reqs = append(reqs, [2]string{"nobody", passwords[0]})
	want = append(want, "ERR")
	path := filepath.Join(t.TempDir(), "htpasswd")
	if err := os.WriteFile(path, []byte(file.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	for i, got := range askHelper(t, helper, path, reqs) {
		if !(got == want[i] || want[i] == "ERR" && strings.HasPrefix(got, "ERR")) {
			t.Errorf("request %d (user %s, password #%d): %q, want %s", i, reqs[i][0], i/2, got, want[i])
		}
	}
}

// TestHtpasswdAgrees checks both ways against Apache's htpasswd: our lines
// verify with `htpasswd -vb`, and the lines `htpasswd -nbB` writes verify
// with Verify and with basic_ncsa_auth.
func TestHtpasswdAgrees(t *testing.T) {
	helper := ncsaAuth(t)
	htpasswd := testgate.NeedBinary(t, "htpasswd", "Apache's htpasswd (apt-get install apache2-utils; make squid-install)")
	dir := t.TempDir()
	for i, pw := range passwords {
		user := fmt.Sprintf("crawler%d", i)
		ours := filepath.Join(dir, fmt.Sprintf("ours%d", i))
		line, err := Line(user, pw)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(ours, []byte(line), 0o600); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command(htpasswd, "-vb", ours, user, pw).CombinedOutput(); err != nil {
			t.Errorf("htpasswd -vb refuses our line for password #%d: %v: %s", i, err, out)
		}
		out, err := exec.Command(htpasswd, "-vb", ours, user, pw[:len(pw)-1]+"!").CombinedOutput()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 3 {
			t.Errorf("htpasswd -vb with a wrong password #%d: %v (%s), want exit status 3", i, err, out)
		}

		theirs, err := exec.Command(htpasswd, "-nbB", user, pw).Output()
		if err != nil {
			t.Fatalf("htpasswd -nbB: %v", err)
		}
		if !strings.HasPrefix(string(theirs), user+":$2y$") {
			t.Fatalf("htpasswd -nbB wrote %q, want a $2y$ line", theirs)
		}
		if !Verify(theirs, user, pw) || Verify(theirs, user, pw[:len(pw)-1]) {
			t.Errorf("Verify disagrees with htpasswd's line for password #%d", i)
		}
		path := filepath.Join(dir, fmt.Sprintf("theirs%d", i))
		if err := os.WriteFile(path, theirs, 0o600); err != nil {
			t.Fatal(err)
		}
		got := askHelper(t, helper, path, [][2]string{{user, pw}, {user, "wrong"}})
		if got[0] != "OK" || !strings.HasPrefix(got[1], "ERR") {
			t.Errorf("basic_ncsa_auth on htpasswd's line for password #%d: %q, want OK then ERR", i, got)
		}
	}
}
