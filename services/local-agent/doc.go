// Package localagent is the local-agent service module; its binary is in cmd/local-agent and its
// logic under internal/.
package localagent
