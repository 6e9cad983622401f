// Package gateway is the crawler gateway's module: one forward-proxy
// endpoint in front of the fleet (docs/gateway.md). cmd/gateway is the
// binary; internal/route picks the proxy of each connection and keeps
// sessions sticky, internal/ban recognises banned proxies by their
// responses, internal/forward is the HTTP and CONNECT proxy itself,
// internal/fleet its NATS side (the views it follows, the reports it
// sends, its micro service) and internal/clients checks client passwords.
package gateway
