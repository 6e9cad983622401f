// Package health is the health service module; its binary is in cmd/health and its
// logic under internal/.
package health
