// Package buildinfo holds what the build stamps into every binary.
package buildinfo

// Version is the proxyfleet version every service announces: in its NATS
// micro service info, and an agent's in its heartbeat. It is semver, as
// micro services require; `make build` stamps the one scripts/version.sh
// derives from RELEASES (-ldflags "-X proxyfleet/pkg/buildinfo.Version=
// 0.2.0-dev+<commit>"), and every binary's --version prints it. A build
// without the stamp (plain go build) says the first release's.
var Version = "0.1.0"
