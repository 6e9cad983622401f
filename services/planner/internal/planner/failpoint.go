//go:build !failpoint

package planner

// beforeFencedAppend is a failpoint for tests; see failpoint_on.go.
func (p *Planner) beforeFencedAppend() {}
