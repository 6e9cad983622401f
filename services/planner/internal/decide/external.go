package decide

import (
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"time"

	"proxyfleet/pkg/egress"
	"proxyfleet/pkg/events"
)

// External pools (provider [events.ProviderExternal]) hold proxies
// proxyfleet never creates: the rules below only record the list. The
// planner speaks for them as the agent of entry and target "external"
// would: a listed proxy is requested and at once running at its address;
// an unlisted one is retired and at once deleted. No command is ever
// sent, and none of the owned pools' rules apply (no replacement, rotation,
// autoscaling, garbage collection or target checks): a verdict that would
// replace an owned proxy disables an external one for the pool's
// disableFor instead ([events.ProxyDisabled]); health returns it to
// service after a good probe once that time has passed.

// Kinds of the external rules' decisions. Each is safe to repeat after a
// crash at any point: the next round reads what was stored and decides
// the rest.
const (
	// List records a listed proxy the pool has no member for: requested
	// (Listed's port and labels) and then, as the external agent, running
	// at Listed.Address.
	List Kind = iota + 100
	// Run appends, as the external agent, running at Listed.Address for a
	// requested member whose running was not stored (a crash in between).
	Run
	// Unlist retires Proxy for Reason and then, as the external agent,
	// appends its deleted: nothing is deleted anywhere.
	Unlist
	// Forget appends, as the external agent, deleted for a retiring
	// member whose deleted was not stored.
	Forget
	// Disable takes Proxy out of service until Until, for Reason.
	Disable
)

// Condition reasons of external pools.
const (
	// ReasonListed: every listed proxy is recorded (Placed).
	ReasonListed = "Listed"
	// ReasonListing: listed proxies are being recorded, or unlisted ones
	// forgotten (Placed, Progressing).
	ReasonListing = "Listing"
	// ReasonExternalFileInvalid: the pool's external.file does not read;
	// the list stays as the pool's last revision recorded it (Placed).
	ReasonExternalFileInvalid = "ExternalFileInvalid"
	// ReasonNoneUsable: no listed proxy is ready (Ready).
	ReasonNoneUsable = "NoneUsable"
	// ReasonUsable: at least one listed proxy is ready (Ready).
	ReasonUsable = "Usable"
)

// ReasonUnlisted is the retiring reason of a proxy no longer listed.
const ReasonUnlisted = "unlisted"

// Listed is one proxy of an external pool's list, as the public spec
// records it: its address ("host:port"), port and labels.
type Listed struct {
	Address string
	Port    int
	Labels  map[string]string
}

// ListedOf returns the proxies spec lists, in list order; entries whose
// URL does not parse (a recorded spec never holds one) are skipped.
func ListedOf(spec *events.PoolSpec) []Listed {
	if spec.External == nil {
		return nil
	}
	out := make([]Listed, 0, len(spec.External.Proxies))
	for _, p := range spec.External.Proxies {
		up, err := events.ParseUpstream(p.URL)
		if err != nil {
			continue
		}
		_, port, _ := net.SplitHostPort(up.Address)
		n, _ := strconv.Atoi(port)
		out = append(out, Listed{Address: up.Address, Port: n, Labels: p.Labels})
	}
	return out
}

// IsExternal reports whether pool is an external pool.
func IsExternal(pool *Pool) bool { return pool.Spec.Provider == events.ProviderExternal }

// ExternalFound is what a pass over an external pool found, for its
// conditions.
type ExternalFound struct {
	// Listed is how many proxies the pool lists.
	Listed int
	// Usable are the ready members; Disabled the disabled ones, Unhealthy
	// the unhealthy ones; Pending counts those not yet probed (requested
	// or running), Recording those being recorded (listed, or requested
	// without their running) and Leaving those being forgotten.
	Usable, Disabled            []Proxy
	Unhealthy                   int
	Pending, Recording, Leaving int
	// HealthDownSince is [Health.Since] while health is down.
	HealthDownSince time.Time
}

// ExternalPlan is what [ReconcileExternal] decided.
type ExternalPlan struct {
	Decisions []Decision
	Found     ExternalFound
}

// ReconcileExternal decides what an external pool needs: members match
// listed proxies by address (a requested member, whose address is
// recorded only with its running, by port and labels); a listed proxy
// without a member is listed, a member without a listed proxy (or whose
// labels changed) is unlisted, a requested member gets its running and a
// retiring one its deleted, and a member unhealthy for longer than
// unhealthyAfter is disabled for disableFor. A member an agent created
// (the pool was an owned one) is retired and deleted by its agent, as in
// an owned pool (Retire, Redelete, Abandon). in.Placement and
// in.Replacements are not read.
func ReconcileExternal(in *Input) ExternalPlan {
	var plan ExternalPlan
	found := &plan.Found
	if in.Health.Down {
		found.HealthDownSince = in.Health.Since
	}
	pool := &in.Pool
	var listed []Listed
	if !pool.Deleted {
		listed = ListedOf(&pool.Spec)
	}
	found.Listed = len(listed)
	byAddr := make(map[string]int, len(listed))
	for i, l := range listed {
		byAddr[l.Address] = i
	}
	claimed := make([]bool, len(listed))
	after := pool.Spec.UnhealthyAfterOrDefault()
	gone := ReasonUnlisted
	if pool.Deleted {
		gone = "pool deleted"
	}
	add := func(d Decision) { plan.Decisions = append(plan.Decisions, d) }
	var requested []Proxy
	for _, x := range in.Members {
		if x.Entry != events.ProviderExternal {
			// A proxy an agent created, left from before the pool
			// became external (re-applied, or deleted and applied
			// again): retired and deleted by its agent, as in an owned
			// pool.
			found.Leaving++
			switch {
			case x.State == events.ProxyRetiring && x.SkipCleanup:
				add(Decision{Kind: Abandon, Proxy: x, Reason: x.Reason})
			case x.State == events.ProxyRetiring:
				if in.Now.Sub(x.UpdatedAt) >= in.Config.RetireTimeout {
					add(Decision{Kind: Redelete, Proxy: x, Reason: x.Reason})
				}
			default:
				add(Decision{Kind: Retire, Proxy: x, Reason: "the pool became external"})
			}
			continue
		}
		switch x.State {
		case events.ProxyRetiring:
			found.Leaving++
			add(Decision{Kind: Forget, Proxy: x, Reason: x.Reason})
			continue
		case events.ProxyFailed:
			// Nobody fails an external proxy; one that is (an old
			// decision) is forgotten like an unlisted one.
			found.Leaving++
			add(Decision{Kind: Unlist, Proxy: x, Reason: "failed: " + x.FailureClass})
			continue
		case events.ProxyRequested:
			requested = append(requested, x)
			continue
		}
		i, ok := byAddr[x.Address]
		switch {
		case !ok || claimed[i]:
			found.Leaving++
			add(Decision{Kind: Unlist, Proxy: x, Reason: gone})
			continue
		case !maps.Equal(x.Labels, listed[i].Labels):
			// Labels are recorded with the request: a proxy listed with
			// new labels is recorded anew.
			found.Leaving++
			add(Decision{Kind: Unlist, Proxy: x, Reason: "listed again with other labels"})
			continue
		}
		claimed[i] = true
		switch x.State {
		case events.ProxyReady:
			found.Usable = append(found.Usable, x)
		case events.ProxyDisabled:
			found.Disabled = append(found.Disabled, x)
		case events.ProxyUnhealthy:
			if IsSick(x, in.AgeNow, after) {
				found.Disabled = append(found.Disabled, x)
				add(Decision{Kind: Disable, Proxy: x, Until: in.Now.Add(pool.Spec.External.DisableForOrDefault()),
					Reason: Truncate(fmt.Sprintf("unhealthy for %s: %s", after, x.Reason), 200)})
			} else {
				found.Unhealthy++
			}
		default:
			found.Pending++
		}
	}
	for _, x := range requested {
		i := slices.IndexFunc(listed, func(l Listed) bool {
			return !claimed[byAddr[l.Address]] && l.Port == x.Port && maps.Equal(l.Labels, x.Labels)
		})
		if i < 0 {
			found.Leaving++
			add(Decision{Kind: Unlist, Proxy: x, Reason: gone})
			continue
		}
		claimed[i] = true
		found.Pending++
		found.Recording++
		add(Decision{Kind: Run, Proxy: x, Listed: listed[i]})
	}
	for i, l := range listed {
		if !claimed[i] {
			found.Pending++
			found.Recording++
			add(Decision{Kind: List, Listed: l})
		}
	}
	return plan
}

// DisableBan is the decision a reported ban of external proxy x takes at
// now: disabled for the pool's disableFor, reason "banned: <rule>" (the
// report's reason, as the API records it). A disabled proxy's ban sets a
// new time: a ban while disabled extends it.
func DisableBan(pool *Pool, x Proxy, reason string, now time.Time) Decision {
	return Decision{Kind: Disable, Proxy: x, Until: now.Add(pool.Spec.External.DisableForOrDefault()), Reason: reason}
}

// CanDisable reports whether external proxy x may be disabled: it is in
// service or already disabled (a proxy being forgotten, or not yet
// running, is not).
func CanDisable(x Proxy) bool {
	switch x.State {
	case events.ProxyRunning, events.ProxyReady, events.ProxyUnhealthy, events.ProxyDisabled:
		return true
	}
	return false
}

// ExternalConditions are an external pool's conditions after a pass that
// found f: Ready counts the usable (ready) members, how many of them cool
// down on some site (cooling, by proxy id), the disabled ones (the
// earliest until, with its reason) and the unhealthy ones; it is True
// while at least one listed proxy is usable. Placed is False with reason
// [ReasonExternalFileInvalid] while the pool's file does not read
// (fileErr, which never quotes a credential). Progressing is True while
// members are recorded or forgotten.
func ExternalConditions(f *ExternalFound, cooling map[string]bool, fileErr string) []events.PoolConditionData {
	cool := 0
	for _, x := range f.Usable {
		if cooling[x.ID] {
			cool++
		}
	}
	msg := fmt.Sprintf("%d listed: %d usable", f.Listed, len(f.Usable))
	if cool > 0 {
		msg += fmt.Sprintf(" (%d cooling on some site)", cool)
	}
	if n := len(f.Disabled); n > 0 {
		first := f.Disabled[0]
		for _, x := range f.Disabled[1:] {
			if x.DisabledUntil.Before(first.DisabledUntil) || first.DisabledUntil.IsZero() {
				first = x
			}
		}
		msg += fmt.Sprintf(", %d disabled", n)
		if !first.DisabledUntil.IsZero() {
			msg += " until " + first.DisabledUntil.UTC().Format("15:04:05Z")
		}
		if first.Reason != "" {
			msg += " (" + Truncate(first.Reason, 120) + ")"
		}
	}
	if f.Unhealthy > 0 {
		msg += fmt.Sprintf(", %d unhealthy", f.Unhealthy)
	}
	if f.Pending > 0 {
		msg += fmt.Sprintf(", %d not yet probed", f.Pending)
	}
	ready := events.PoolConditionData{Type: events.ConditionReady, Status: events.ConditionTrue, Reason: ReasonUsable, Message: msg}
	switch {
	case !f.HealthDownSince.IsZero():
		ready = healthUnavailable(f.HealthDownSince)
	case f.Listed == 0:
		ready.Reason, ready.Message = events.ReasonEnoughReady, "no proxies listed"
	case len(f.Usable) == 0:
		ready.Status, ready.Reason = events.ConditionFalse, ReasonNoneUsable
	}
	placed := events.PoolConditionData{Type: events.ConditionPlaced, Status: events.ConditionTrue, Reason: ReasonListed,
		Message: fmt.Sprintf("every listed proxy is recorded (%d)", f.Listed)}
	if fileErr != "" {
		placed.Status, placed.Reason = events.ConditionFalse, ReasonExternalFileInvalid
		placed.Message = "external.file: " + fileErr + "; the list stays as the pool's last revision recorded it"
	}
	progressing := events.PoolConditionData{Type: events.ConditionProgressing, Status: events.ConditionFalse, Reason: events.ReasonSettled,
		Message: "the pool matches its list"}
	if f.Leaving > 0 || f.Recording > 0 {
		progressing.Status, progressing.Reason = events.ConditionTrue, ReasonListing
		progressing.Message = fmt.Sprintf("recording the list: %d to record, %d to forget", f.Recording, f.Leaving)
	}
	return []events.PoolConditionData{ready, placed, progressing}
}

// ExternalTimer says when a round must look at an external pool again
// although no event touches it: at once after a round that decided
// something (what it stored is confirmed, and a crash's leftovers are
// repaired), when an unhealthy member turns sick, and when the delete of
// a proxy left from an owned pool is due again.
func ExternalTimer(cfg Config, pool *Pool, members []Proxy, decided bool, ageNow time.Time) When {
	t := When{Retry: decided}
	after := pool.Spec.UnhealthyAfterOrDefault()
	for _, x := range members {
		if x.Entry != events.ProviderExternal && x.State == events.ProxyRetiring && !x.SkipCleanup {
			if due := x.UpdatedAt.Add(cfg.RetireTimeout); t.Due.IsZero() || due.Before(t.Due) {
				t.Due = due
			}
		}
		if x.State == events.ProxyUnhealthy && !x.UnhealthySince.IsZero() {
			if due := x.UnhealthySince.Add(after); due.After(ageNow) && (t.AgeDue.IsZero() || due.Before(t.AgeDue)) {
				t.AgeDue = due
			}
		}
	}
	return t
}

// CheckUpstream returns the egress rule that refuses an external proxy at
// addr, or [egress.RuleOK]: the refused ranges of [egress.Ranges]
// (loopback, link-local, private, …) unless one of allow (the planner's
// --external-allow-cidrs) holds the address.
func CheckUpstream(addr netip.Addr, allow []netip.Prefix) egress.Rule {
	addr = addr.Unmap().WithZone("")
	dst := addr
	if v4, ok := egress.Embedded(addr); ok {
		dst = v4
	}
	if slices.ContainsFunc(allow, func(pr netip.Prefix) bool { return pr.Contains(dst) || pr.Contains(addr) }) {
		return egress.RuleOK
	}
	var none egress.Policy
	return none.Check(addr, egress.ConnectPort, true)
}
