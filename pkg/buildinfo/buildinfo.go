// Package buildinfo holds what the build stamps into every binary.
package buildinfo

// Version is the proxyfleet version every service announces: in its NATS
// micro service info, and an agent's in its heartbeat. It is semver, as
// micro services require; `make build` stamps it with the commit
// (-ldflags "-X proxyfleet/pkg/buildinfo.Version=0.1.0+<commit>").
var Version = "0.1.0"
