// Package gateway is the crawler gateway's module: one forward-proxy
// endpoint in front of the fleet (docs/gateway.md). Its logic is under
// internal/: route picks the proxy of each connection and keeps sessions
// sticky, ban recognises banned proxies by their responses. The service
// binary (cmd/gateway) is not written yet.
package gateway
