// Package e2e runs the whole system as real processes (planner, health and
// local-agent binaries) against a real JetStream server, and checks the
// operator-visible behaviour end to end: pools converge, proxies carry real
// HTTP, crashes and restarts neither lose intent nor duplicate instances, and
// views rebuild identically from the event log.
package e2e
