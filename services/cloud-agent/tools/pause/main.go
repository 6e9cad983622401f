// Command pause is the sandbox ("pause") container of the Kubernetes node
// tier: it holds a Pod's namespaces by sleeping until it is told to stop.
// It is built statically and packed into a one-file image
// (scripts/kube-node-images.sh), so the tier needs no registry.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	// As PID 1 of the sandbox it inherits orphans; SIGCHLD is reaped by
	// the Go runtime only for its own children, so reap here too.
	signal.Notify(sig, syscall.SIGCHLD)
	for s := range sig {
		if s == syscall.SIGCHLD {
			for {
				pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
			continue
		}
		os.Exit(0)
	}
}
