package service

import (
	"flag"
	"fmt"
	"io"
	"os"

	"proxyfleet/pkg/buildinfo"
)

// versionOut and versionExit are where --version writes and how it ends
// the process; a test replaces them.
var (
	versionOut  io.Writer = os.Stdout
	versionExit           = os.Exit
)

// registerVersion adds --version to fs: it prints "<service> <version>"
// (buildinfo.Version, which `make build` derives from RELEASES) on stdout
// and exits 0 at once, before any other flag is checked or anything
// starts, so an operator can ask any binary what it is.
func registerVersion(fs *flag.FlagSet, service string) {
	fs.BoolFunc("version", "print this binary's proxyfleet version (\""+service+" <semver>\") and exit", func(string) error {
		fmt.Fprintf(versionOut, "%s %s\n", service, buildinfo.Version)
		versionExit(0)
		return nil
	})
}
