// Package planner is the planner service module: the operator API and the
// reconciler. Its binary is cmd/planner; its logic is internal/planner.
package planner
