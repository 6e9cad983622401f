package srcroot

import (
	"os"
	"path/filepath"
	"testing"
)

func TestDirFindsTheWorkspace(t *testing.T) {
	root, err := Dir()
	if err != nil {
		t.Fatal(err)
	}
	// This file is pkg/internal/srcroot/srcroot_test.go of the tree found.
	if _, err := os.Stat(filepath.Join(root, "pkg", "internal", "srcroot", "srcroot_test.go")); err != nil {
		t.Fatalf("Dir() = %s, which does not hold this package: %v", root, err)
	}
	if got, want := Join("pkg", "events"), filepath.Join(root, "pkg", "events"); got != want {
		t.Errorf("Join = %s, want %s", got, want)
	}
}

func TestDirOutsideTheTree(t *testing.T) {
	t.Chdir(t.TempDir())
	if dir, err := Dir(); err == nil {
		t.Fatalf("Dir() outside the tree = %s, want an error", dir)
	}
	if got := Join("pkg", "events"); got != filepath.Join("pkg", "events") {
		t.Errorf("Join outside the tree = %s, want the relative path", got)
	}
}
