// Package planner is the planner service module; its binary is in cmd/planner and its
// logic under internal/.
package planner
