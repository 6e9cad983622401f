package e2e_test

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
)

// serviceTags are the build tags of the service binaries the tests run:
// the Makefile's BUILD_TAGS, which make build uses, so that the tests run
// what ships and every tier compiles one variant of the services'
// dependencies.
const serviceTags = "grpcnotrace"

// goBuild builds a binary as `go build -o out args...` would (args: flags,
// then the package), through a directory of links shared by every test
// process of the machine: each tier of make test-all is a go test process
// of its own, and each used to link every service again (seconds of CPU a
// binary), though go's build cache held all they are made of. Under a
// lock, go build updates the shared copy for these args (it leaves a copy
// whose build ID is current alone, so only the first process links), and
// out becomes a hard link to it: a later rebuild of the shared copy
// replaces the file, never the one out names, and the processes started
// from out show out as their executable. Anything the shared directory
// cannot do (another user's, another file system) falls back to building
// out directly; a build that fails is not tried twice.
func goBuild(out string, args ...string) error {
	err := sharedBuild(out, args)
	var failed buildFailed
	if err == nil || errors.As(err, &failed) {
		return err
	}
	cmd := exec.Command("go", append([]string{"build", "-o", out}, args...)...)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build -o %s %s: %v\n%s", out, strings.Join(args, " "), err, b)
	}
	return nil
}

// buildFailed is go build's own failure, as opposed to the shared
// directory's.
type buildFailed struct{ error }

func sharedBuild(out string, args []string) error {
	root := filepath.Join(os.TempDir(), fmt.Sprintf("proxyfleet-e2e-bin-%d", os.Getuid()))
	// The args and the GOFLAGS they are built with name the shared copy,
	// not the checkout: go build relinks a copy another tree left, and
	// with -trimpath (make's) two clones of one commit link the same
	// binary, so a clone reuses what the last one linked and the
	// directory does not grow with each.
	sum := sha256.Sum256([]byte(strings.Join(append([]string{os.Getenv("GOFLAGS")}, args...), "\x00")))
	dir := filepath.Join(root, hex.EncodeToString(sum[:8]))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	lock, err := os.OpenFile(filepath.Join(root, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return err
	}
	defer lock.Close() // and so unlocked
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return err
	}
	shared := filepath.Join(dir, filepath.Base(out))
	cmd := exec.Command("go", append([]string{"build", "-o", shared}, args...)...)
	if b, err := cmd.CombinedOutput(); err != nil {
		return buildFailed{fmt.Errorf("go build -o %s %s: %v\n%s", shared, strings.Join(args, " "), err, b)}
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	_ = os.Remove(out)
	return os.Link(shared, out)
}
