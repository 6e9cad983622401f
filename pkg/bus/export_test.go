package bus

import "time"

// ReadAhead is the readers' prefetch, for a baseline read that matches it.
const ReadAhead = readAhead

// SetReadEndHook runs hook in every read once it knows its end, and makes
// a read recheck a missing end after recheck; the test's cleanup undoes
// both.
func SetReadEndHook(t interface{ Cleanup(func()) }, hook func(), recheck time.Duration) {
	prevHook, prevRecheck := readEndHook, endRecheck
	readEndHook, endRecheck = hook, recheck
	t.Cleanup(func() { readEndHook, endRecheck = prevHook, prevRecheck })
}
