// Package kvmagent is the kvm-agent service module; its binary is in cmd/kvm-agent and its
// logic under internal/.
package kvmagent
