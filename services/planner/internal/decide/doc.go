// Package decide holds the planner's rules as pure functions: given a
// read-only view of one pool (its spec, its live members, the live
// targets and their load) and the current time, they return what the
// pool needs (decisions) and what the round found (for the pool's
// conditions and for when to look at it again).
//
// Nothing here talks to NATS, starts goroutines, reads a clock or logs:
// the planner's reconciler builds the [Input] from its projection, calls
// [Pool], hands the [Decision]s to its one writer (which checks what only
// effects can know, such as whether the pool's secrets can be read and
// sealed to the chosen agent), and then calls [Conditions] and [Timer]
// with what the writer found. So every rule is a table test, and every
// replica, replaying the same log, decides the same.
//
// The rules, in the order a round applies them to one pool:
//
//   - failed members are retired (the fill replaces them);
//   - retiring members: with skipCleanup they are abandoned, otherwise
//     their delete is re-issued after RetireTimeout, and after
//     StuckDeletes re-issues they are reported stuck ([IsDeleteStuck],
//     the pool's Cleanup condition);
//   - timeouts: a create re-issued after CreateTimeout (or the proxy
//     failed, when its agent is gone or the create was issued
//     MaxCreateAttempts times), provisioning and running (never ready)
//     members failed with class timeout (running ones not while health
//     is down, and counting from its return: [ReadyDeadline]);
//   - heal: sick and replaced members are condemned and retired once
//     their replacement is ready ([Condemned]); in a pool with
//     distinctEgress, so is the newer of two members sharing an egress
//     address, one at a time;
//   - scale-down in [RetireOrder], or the fill: one new proxy per missing
//     one, each placed by [Place] (never on a target whose recent check
//     failed: [Placement.Failing]; only on targets whose labels the pool's
//     placement accepts: [Labelled]; with a spread, on the label value
//     furthest below its weighted share), replacing the sick first;
//   - rotation: one outdated or aged member replaced, surge first;
//   - rebalance: in a pool with a placement, at size and with nothing in
//     flight, one member that sits where the placement no longer puts
//     proxies, or on a spread value over its share ([Shares]), replaced
//     surge first by a proxy on a value under its share; then the spread
//     values short of their share that no target can take are noted for
//     the Placed condition.
package decide
