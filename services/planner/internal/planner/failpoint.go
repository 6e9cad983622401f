//go:build !failpoint

package planner

import "log/slog"

// failpoints are test failpoints, compiled in only with -tags failpoint
// (see failpoint_on.go); here they do nothing.
type failpoints struct{}

func (*failpoints) beforeDecision(*slog.Logger, func()) {}
