// Package console is the operator console's module: a server-rendered web
// console of the fleet (docs/console.md). cmd/console is the binary;
// internal/fleetview follows the KV views into the indexes the pages read,
// internal/tail follows the event log's decisions, internal/traffic sums
// the gateways' request log, internal/access holds users, sessions and CSRF
// tokens, and internal/web serves the pages, the actions and the live
// updates.
package console
