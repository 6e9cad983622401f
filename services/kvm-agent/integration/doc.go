// Package integration holds the kvm-agent's tests against a real libvirtd
// with QEMU (build tag "integration", run by make test-kvm, which starts the
// daemon). Without a reachable libvirtd they skip, or fail when
// PROXYFLEET_REQUIRE_INTEGRATION=1.
package integration
