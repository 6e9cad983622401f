package service

import "io"

// SetVersionHooks points --version at out and exit for a test and returns
// what restores them.
func SetVersionHooks(out io.Writer, exit func(int)) (restore func()) {
	oldOut, oldExit := versionOut, versionExit
	versionOut, versionExit = out, exit
	return func() { versionOut, versionExit = oldOut, oldExit }
}
