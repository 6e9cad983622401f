// Package srcroot finds the repository's source tree, for test helpers
// that read the testdata of another package from the tests of any module.
//
// It walks up from the working directory (a test's is its package's
// directory) to the directory holding go.work. It does not ask
// runtime.Caller for its own file: in a -trimpath build, which make uses so
// that every checkout shares one build cache, that name is
// module-relative ("proxyfleet/pkg/..."), not a path.
package srcroot

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// Dir returns the directory that holds go.work, at or above the working
// directory.
func Dir() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for dir := wd; ; dir = filepath.Dir(dir) {
		if _, err := os.Stat(filepath.Join(dir, "go.work")); err == nil {
			return dir, nil
		} else if !errors.Is(err, os.ErrNotExist) {
			return "", err
		}
		if filepath.Dir(dir) == dir {
			return "", fmt.Errorf("no go.work at or above %s: run from inside the source tree", wd)
		}
	}
}

// Join returns the path of elem inside the source tree. Outside it, it
// returns elem joined as it is (relative), so that the caller's read fails
// naming the file it looked for.
func Join(elem ...string) string {
	root, err := Dir()
	if err != nil {
		return filepath.Join(elem...)
	}
	return filepath.Join(append([]string{root}, elem...)...)
}
