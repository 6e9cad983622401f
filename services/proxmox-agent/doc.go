// Package proxmoxagent is the proxmox-agent service module; its binary is in cmd/proxmox-agent and its
// logic under internal/.
package proxmoxagent
