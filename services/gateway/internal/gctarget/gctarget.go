// Package gctarget sets the gateway's garbage collection target.
//
// The gateway's live heap is small (routing tables, idle connections'
// buffers) while each request allocates a few kilobytes that die with it,
// so Go's default target (GOGC=100: collect when the heap doubled)
// collects many times a second under load. [Percent] trades a few
// megabytes of heap for a collector that runs a quarter as often.
package gctarget

import (
	"os"
	"runtime/debug"
)

// Percent is the gateway's default GC target, as GOGC would set it.
const Percent = 400

// Apply sets the GC target to [Percent] unless the environment variable
// GOGC chose one, which then stays in effect. It returns the target in
// effect now (-1: collection off, GOGC=off).
func Apply() int {
	if _, set := os.LookupEnv("GOGC"); set {
		p := debug.SetGCPercent(100)
		debug.SetGCPercent(p)
		return p
	}
	debug.SetGCPercent(Percent)
	return Percent
}
