package e2e_test

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"proxyfleet/pkg/buildinfo"
)

// repoRoot is the repository's root, where RELEASES and scripts/ are.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// release is one line of RELEASES.
type release struct {
	Version, Commit, Date, Note string
}

var (
	semverRe = regexp.MustCompile(`^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$`)
	commitRe = regexp.MustCompile(`^[0-9a-f]{40}$`)
	dateRe   = regexp.MustCompile(`^[0-9]{4}-[0-9]{2}-[0-9]{2}$`)
)

// readReleases parses RELEASES: every line a release, in increasing
// version order, each field well formed.
func readReleases(t *testing.T, path string) []release {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []release
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.SplitN(line, " ", 4)
		if len(fields) < 4 || !semverRe.MatchString(fields[0]) || !commitRe.MatchString(fields[1]) || !dateRe.MatchString(fields[2]) || strings.TrimSpace(fields[3]) == "" {
			t.Fatalf("%s:%d: want \"<major.minor.patch> <40-hex commit> <YYYY-MM-DD> <note>\", got %q", path, n, line)
		}
		r := release{fields[0], fields[1], fields[2], strings.TrimSpace(fields[3])}
		if len(out) > 0 && !semverLess(out[len(out)-1].Version, r.Version) {
			t.Fatalf("%s:%d: %s does not follow %s: releases are listed oldest first", path, n, r.Version, out[len(out)-1].Version)
		}
		out = append(out, r)
	}
	if len(out) == 0 {
		t.Fatalf("%s lists no release", path)
	}
	return out
}

func semverLess(a, b string) bool {
	pa, pb := strings.Split(a, "."), strings.Split(b, ".")
	for i := range 3 {
		x, _ := strconv.Atoi(pa[i])
		y, _ := strconv.Atoi(pb[i])
		if x != y {
			return x < y
		}
	}
	return false
}

// TestReleases: RELEASES is well formed, its first release is 0.1.0, and
// every release's commit is in the repository's history when the history
// is at hand (make test-upgrade builds the previous release from it).
func TestReleases(t *testing.T) {
	root := repoRoot(t)
	rs := readReleases(t, filepath.Join(root, "RELEASES"))
	if rs[0].Version != "0.1.0" {
		t.Fatalf("the first release is %s, want 0.1.0", rs[0].Version)
	}
	shallow, err := exec.Command("git", "-C", root, "rev-parse", "--is-shallow-repository").Output()
	if err != nil || strings.TrimSpace(string(shallow)) != "false" {
		t.Logf("no whole git history at hand (%v, shallow %q): the releases' commits are not checked", err, shallow)
		return
	}
	for _, r := range rs {
		if out, err := exec.Command("git", "-C", root, "cat-file", "-e", r.Commit+"^{commit}").CombinedOutput(); err != nil {
			t.Errorf("release %s: commit %s is not in the repository's history: %v %s", r.Version, r.Commit, err, out)
		}
	}
}

// TestVersionScript runs scripts/version.sh in a repository of its own:
// a release's commit gets the release's version, any other commit the
// next minor's pre-release with the commit, a copy without history the
// pre-release alone, and a malformed RELEASES is refused by line.
func TestVersionScript(t *testing.T) {
	script := filepath.Join(repoRoot(t), "scripts", "version.sh")
	dir := t.TempDir()
	git := func(args ...string) string {
		t.Helper()
		cmd := exec.Command("git", append([]string{"-C", dir, "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"}, args...)...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	version := func(releases string) (string, error) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, "RELEASES"), []byte(releases), 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(script, filepath.Join(dir, "RELEASES")).CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
	want := func(releases, v string) {
		t.Helper()
		got, err := version(releases)
		if err != nil || got != v {
			t.Fatalf("version.sh with RELEASES\n%s= %q, %v; want %q", releases, got, err, v)
		}
	}

	// No history: the next minor's pre-release.
	want("# comment\n\n0.1.0 "+strings.Repeat("a", 40)+" 2026-12-05 first\n", "0.2.0-dev")

	git("init", "-q")
	if err := os.WriteFile(filepath.Join(dir, "a"), []byte("a"), 0o644); err != nil {
		t.Fatal(err)
	}
	git("add", "a")
	git("commit", "-q", "-m", "a")
	first := git("rev-parse", "HEAD")
	one := "0.1.0 " + first + " 2026-12-05 first\n"
	want(one, "0.1.0")

	git("commit", "-q", "--allow-empty", "-m", "b")
	second := git("rev-parse", "HEAD")
	want(one, "0.2.0-dev+"+second[:12])
	// The latest release counts, whatever the line order.
	want("0.9.3 "+strings.Repeat("b", 40)+" 2026-12-06 later\n"+one, "0.10.0-dev+"+second[:12])
	want(one+"0.2.0 "+second+" 2026-12-06 second\n", "0.2.0")
	// An earlier release's commit checked out again is that release.
	git("checkout", "-q", first)
	want(one+"0.2.0 "+second+" 2026-12-06 second\n", "0.1.0")

	for _, bad := range []struct{ releases, msg string }{
		{"0.1 " + first + " 2026-12-05 x\n", ":1: version 0.1 is not major.minor.patch"},
		{"# c\n0.1.0 " + first[:12] + " 2026-12-05 x\n", ":2: commit " + first[:12] + " is not 40 lowercase hex digits"},
		{"0.1.0 " + first + " 5.12.2026 x\n", ":1: date 5.12.2026 is not YYYY-MM-DD"},
		{"# nothing yet\n", "lists no release"},
	} {
		got, err := version(bad.releases)
		if err == nil || !strings.Contains(got, bad.msg) {
			t.Errorf("version.sh with RELEASES %q = %q, %v; want an error containing %q", bad.releases, got, err, bad.msg)
		}
	}
}

// TestVersionFlagOfServices: each service binary answers --version with
// its name and buildinfo.Version, and starts nothing.
func TestVersionFlagOfServices(t *testing.T) {
	needBinaries(t)
	for _, svc := range []string{"planner", "health", "local-agent", "gateway"} {
		out, err := exec.Command(filepath.Join(binDir, svc), "--version").Output()
		if err != nil {
			t.Fatalf("%s --version: %v", svc, err)
		}
		if want := svc + " " + buildinfo.Version + "\n"; string(out) != want {
			t.Errorf("%s --version printed %q, want %q", svc, out, want)
		}
	}
}
