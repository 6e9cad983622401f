// Package replica names one replica of a service among its peers: the
// planner's replica id (its leader lease, its terms), health's replica id
// (its key in fleet-health) and the gateway's name (its fleet-demand keys
// and subjects) all default to [ID].
package replica

import (
	"os"
	"strconv"
)

// maxHost is the most of the hostname an id keeps: the gateway's name,
// the strictest user, holds at most 64 characters.
const maxHost = 50

// ID is "<host>-<suffix>": host is this machine's hostname, each character
// other than an ASCII letter, digit, '-' or '_' replaced by '-' and cut to
// 50 characters, or service when the hostname is unknown. The id is then
// one NATS subject token, one KV key token and a file name.
//
// suffix tells apart the replicas of one host: [PID] for a replica that
// only needs to differ from those running beside it (the planner,
// health), a listening port for one that should keep its id across
// restarts (the gateway, whose demand keys a restart then overwrites
// instead of doubling).
func ID(service, suffix string) string {
	host, err := os.Hostname()
	if err != nil {
		host = ""
	}
	return id(host, service, suffix)
}

func id(host, service, suffix string) string {
	if host == "" {
		host = service
	}
	b := []byte(host)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			b[i] = '-'
		}
	}
	if len(b) > maxHost {
		b = b[:maxHost]
	}
	return string(b) + "-" + suffix
}

// PID is this process's id, as an [ID] suffix.
func PID() string { return strconv.Itoa(os.Getpid()) }
