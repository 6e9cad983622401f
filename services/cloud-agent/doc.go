// Package cloudagent is the cloud-agent service module; its binary is in cmd/cloud-agent and its
// logic under internal/.
package cloudagent
