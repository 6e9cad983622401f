package decide

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/events"
)

// marked is a marked instance of proxy id of pool p, created by entry
// local, named after its proxy.
func marked(id string) Instance {
	return Instance{Name: events.InstanceName(id), ProviderID: "pid-" + id, Proxy: id, Pool: "p", Entry: "local"}
}

// gcLines writes a verdict as the GC table does: one line per finding,
// "<finding> <target>/<instance or proxy>", then the memory as
// "orphan <target>/<instance> since -<age>" and
// "missing <proxy> on <target> since -<age>", sorted.
func gcLines(v GCVerdict) []string {
	var out []string
	orphans := func(what string, os []Orphan) {
		for _, o := range os {
			out = append(out, fmt.Sprintf("%s %s/%s", what, o.Target, o.Instance.Name))
		}
	}
	proxies := func(what string, xs []Proxy) {
		for _, x := range xs {
			out = append(out, fmt.Sprintf("%s %s/%s", what, x.Target, x.ID))
		}
	}
	orphans("delete", v.Orphans)
	proxies("vanished", v.Vanished)
	orphans("misnamed", v.Misnamed)
	orphans("new-orphan", v.NewOrphans)
	proxies("new-missing", v.NewMissing)
	for k, since := range v.Memory.OrphanSince {
		out = append(out, fmt.Sprintf("orphan %s/%s since -%s", strings.TrimPrefix(k.Target, "local."), k.Instance, t0.Sub(since)))
	}
	for id, m := range v.Memory.MissingSince {
		out = append(out, fmt.Sprintf("missing %s on %s since -%s", id, strings.TrimPrefix(m.Target, "local."), t0.Sub(m.Since)))
	}
	slices.Sort(out)
	return out
}

// The garbage collector's verdicts. Every case judges at t0 with a grace
// of a minute; targets are of entry local.
func TestGC(t *testing.T) {
	const grace = time.Minute
	ghost := events.InstanceName("p-ghost")
	up := px("p-up", "t1", events.ProxyReady)
	cases := []struct {
		name string
		// answered are the inventories by target name; a target absent
		// did not answer.
		answered map[string][]Instance
		keeps    []string // the proxies whose instance the state keeps
		members  []Proxy
		orphans  map[string]time.Duration // "<target>/<instance>": seen this long ago
		missing  map[string]time.Duration // "<proxy>@<target>": missing this long ago
		want     []string
	}{
		{name: "an unmarked instance is never touched",
			answered: map[string][]Instance{"t1": {{Name: "vm-by-hand", ProviderID: "pid-x"}}}},
		{name: "another entry's instance is never touched",
			answered: map[string][]Instance{"t1": {func() Instance { i := marked("p-ghost"); i.Entry = "other"; return i }()}}},
		{name: "a marker whose proxy id breaks the identifier rule is never touched",
			answered: map[string][]Instance{"t1": {func() Instance { i := marked("p-ghost"); i.Proxy = "Bad_Id"; return i }()}}},
		{name: "a marked instance whose name does not derive from its proxy id is reported, not touched",
			answered: map[string][]Instance{"t1": {func() Instance { i := marked("p-ghost"); i.Name = "px-elsewhere"; return i }()}},
			want:     []string{"misnamed t1/px-elsewhere"}},
		{name: "the instance of a proxy the state keeps (live, retiring or abandoned) is no orphan",
			answered: map[string][]Instance{"t1": {marked("p-up")}}, keeps: []string{"p-up"}, members: []Proxy{up}},
		{name: "an orphan first seen is remembered, not deleted",
			answered: map[string][]Instance{"t1": {marked("p-ghost")}},
			want:     []string{"new-orphan t1/" + ghost, "orphan t1/" + ghost + " since -0s"}},
		{name: "an orphan seen for exactly the grace period waits",
			answered: map[string][]Instance{"t1": {marked("p-ghost")}}, orphans: map[string]time.Duration{"t1/" + ghost: grace},
			want: []string{"orphan t1/" + ghost + " since -1m0s"}},
		{name: "an orphan seen for longer than the grace period is deleted and seen afresh",
			answered: map[string][]Instance{"t1": {marked("p-ghost")}}, orphans: map[string]time.Duration{"t1/" + ghost: 2 * grace},
			want: []string{"delete t1/" + ghost, "orphan t1/" + ghost + " since -0s"}},
		{name: "the lingering instance of a deleted proxy is an orphan like any other",
			answered: map[string][]Instance{"t1": {marked("p-done")}}, orphans: map[string]time.Duration{"t1/" + events.InstanceName("p-done"): 2 * grace},
			want: []string{"delete t1/" + events.InstanceName("p-done"), "orphan t1/" + events.InstanceName("p-done") + " since -0s"}},
		{name: "an orphan its answering target no longer lists is forgotten",
			answered: map[string][]Instance{"t1": {}}, orphans: map[string]time.Duration{"t1/" + ghost: 2 * grace}},
		{name: "an orphan whose proxy the state now keeps is forgotten",
			answered: map[string][]Instance{"t1": {marked("p-ghost")}}, keeps: []string{"p-ghost"}, orphans: map[string]time.Duration{"t1/" + ghost: 2 * grace}},
		{name: "a silent target's orphans are remembered",
			answered: map[string][]Instance{"t2": {}}, orphans: map[string]time.Duration{"t1/" + ghost: 2 * grace},
			want: []string{"orphan t1/" + ghost + " since -2m0s"}},
		{name: "an up proxy listed by name is not missing",
			answered: map[string][]Instance{"t1": {marked("p-up")}}, keeps: []string{"p-up"}, members: []Proxy{up}},
		{name: "an up proxy listed by its marker's proxy id is not missing",
			answered: map[string][]Instance{"t1": {func() Instance { i := marked("p-up"); i.Name = "renamed"; return i }()}}, keeps: []string{"p-up"}, members: []Proxy{up},
			want: []string{"misnamed t1/renamed"}},
		{name: "an up proxy first found missing is remembered, not failed",
			answered: map[string][]Instance{"t1": {}}, keeps: []string{"p-up"}, members: []Proxy{up},
			want: []string{"missing p-up on t1 since -0s", "new-missing t1/p-up"}},
		{name: "an up proxy missing for exactly the grace period waits",
			answered: map[string][]Instance{"t1": {}}, keeps: []string{"p-up"}, members: []Proxy{up}, missing: map[string]time.Duration{"p-up@t1": grace},
			want: []string{"missing p-up on t1 since -1m0s"}},
		{name: "an up proxy missing for longer than the grace period vanished",
			answered: map[string][]Instance{"t1": {}}, keeps: []string{"p-up"}, members: []Proxy{up}, missing: map[string]time.Duration{"p-up@t1": 2 * grace},
			want: []string{"missing p-up on t1 since -2m0s", "vanished t1/p-up"}},
		{name: "unhealthy and running proxies are up too",
			answered: map[string][]Instance{"t1": {}}, keeps: []string{"a", "b"},
			members: []Proxy{px("a", "t1", events.ProxyUnhealthy), px("b", "t1", events.ProxyRunning)}, missing: map[string]time.Duration{"a@t1": 2 * grace, "b@t1": 2 * grace},
			want: []string{"missing a on t1 since -2m0s", "missing b on t1 since -2m0s", "vanished t1/a", "vanished t1/b"}},
		{name: "a proxy not up yet is not judged, and its memory is dropped",
			answered: map[string][]Instance{"t1": {}}, keeps: []string{"p-new"},
			members: []Proxy{px("p-new", "t1", events.ProxyProvisioning)}, missing: map[string]time.Duration{"p-new@t1": 2 * grace}},
		{name: "missing since another target: the grace period starts again",
			answered: map[string][]Instance{"t1": {}}, keeps: []string{"p-up"}, members: []Proxy{up}, missing: map[string]time.Duration{"p-up@t9": 2 * grace},
			want: []string{"missing p-up on t1 since -0s", "new-missing t1/p-up"}},
		{name: "a silent target's proxies are not judged and their memory is kept",
			answered: map[string][]Instance{"t2": {}}, keeps: []string{"p-up"}, members: []Proxy{up}, missing: map[string]time.Duration{"p-up@t1": 2 * grace},
			want: []string{"missing p-up on t1 since -2m0s"}},
		{name: "a proxy listed again is forgotten",
			answered: map[string][]Instance{"t1": {marked("p-up")}}, keeps: []string{"p-up"}, members: []Proxy{up}, missing: map[string]time.Duration{"p-up@t1": 2 * grace}},
		{name: "a proxy the state no longer holds is forgotten",
			answered: map[string][]Instance{"t2": {}}, missing: map[string]time.Duration{"p-gone@t1": 2 * grace}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			answered := map[string]Inventory{}
			for target, list := range tc.answered {
				answered[TargetKey("local", target)] = NewInventory("local", target, list)
			}
			mem := GCMemory{OrphanSince: map[OrphanKey]time.Time{}, MissingSince: map[string]Missing{}}
			for k, ago := range tc.orphans {
				target, inst, _ := strings.Cut(k, "/")
				mem.OrphanSince[OrphanKey{Target: TargetKey("local", target), Instance: inst}] = t0.Add(-ago)
			}
			for k, ago := range tc.missing {
				id, target, _ := strings.Cut(k, "@")
				mem.MissingSince[id] = Missing{Target: TargetKey("local", target), Since: t0.Add(-ago)}
			}
			before := gcLines(GCVerdict{Memory: mem})
			states := map[string]string{}
			for _, x := range tc.members {
				states[x.ID] = x.State
			}
			v := GC(GCInput{
				Now: t0, Grace: grace, Answered: answered,
				Keeps: func(id string) bool { return slices.Contains(tc.keeps, id) },
				Members: func(yield func(*Proxy) bool) {
					for i := range tc.members {
						if !yield(&tc.members[i]) {
							return
						}
					}
				},
				StateOf: func(id string) string { return states[id] },
				Memory:  mem,
			})
			want := slices.Sorted(slices.Values(tc.want))
			if got := gcLines(v); !slices.Equal(got, want) {
				t.Errorf("verdict:\n got  %s\n want %s", strings.Join(got, "\n      "), strings.Join(want, "\n      "))
			}
			if got := gcLines(GCVerdict{Memory: mem}); !slices.Equal(got, before) {
				t.Errorf("GC changed its input's memory: %v", got)
			}
		})
	}
}

// How an orphan is deleted, from its proxy's events; the orphan is on
// local/t1.
func TestDeleteOrphan(t *testing.T) {
	const id = "p-ghost"
	o := Orphan{Entry: "local", Target: "t1", Instance: marked(id)}
	placed := events.Observer{Entry: "local", Target: "t1"}
	other := events.Observer{Entry: "local", Target: "t2"}
	agent := events.AgentSource("local", "t1")
	ev := func(seq uint64, kind, source string, by events.Observer) Fact {
		return Fact{Seq: seq, Aggregate: events.AggregateProxy, ID: id, Kind: kind, Source: source, By: by}
	}
	requested := ev(1, events.ProxyRequested, events.SourcePlanner, events.Observer{})
	cases := []struct {
		name     string
		evs      []Fact
		listedAt uint64
		want     OrphanDelete
	}{
		{name: "a proxy the log never held: retire it expecting nothing, first delete",
			want: OrphanDelete{Retire: true, LastSeq: 0, Attempt: 1}},
		{name: "a deleted proxy's lingering instance: retire it again, first delete",
			evs:  []Fact{requested, ev(2, events.ProxyRunning, agent, placed), ev(3, events.ProxyDeleted, agent, placed)},
			want: OrphanDelete{Retire: true, LastSeq: 3, Attempt: 1}},
		{name: "retired once and deleted: the next retirement's delete is the second",
			evs:  []Fact{requested, ev(2, events.ProxyRetiring, events.SourcePlanner, events.Observer{}), ev(3, events.ProxyDeleted, agent, placed)},
			want: OrphanDelete{Retire: true, LastSeq: 3, Attempt: 2}},
		{name: "its last event a retiring already: only the delete again, same attempt",
			evs:  []Fact{requested, ev(2, events.ProxyRetiring, events.SourcePlanner, events.Observer{})},
			want: OrphanDelete{LastSeq: 2, Attempt: 1}},
		{name: "abandoned once: never touched",
			evs:  []Fact{requested, ev(2, events.ProxyAbandoned, events.SourcePlanner, events.Observer{}), ev(3, events.ProxyDeleted, agent, placed)},
			want: OrphanDelete{Skip: true}},
		{name: "an agent's forged abandoned is ignored, its sequence expected",
			evs:  []Fact{requested, ev(2, events.ProxyDeleted, agent, placed), ev(3, events.ProxyAbandoned, agent, placed)},
			want: OrphanDelete{Retire: true, LastSeq: 3, Attempt: 1}},
		{name: "an agent's forged retiring counts no attempt",
			evs:  []Fact{requested, ev(2, events.ProxyRetiring, agent, placed)},
			want: OrphanDelete{Retire: true, LastSeq: 2, Attempt: 1}},
		{name: "another agent's observation decides nothing but moves the sequence",
			evs:  []Fact{requested, ev(2, events.ProxyRetiring, events.SourcePlanner, events.Observer{}), ev(3, events.ProxyDeleted, events.AgentSource("local", "t2"), other)},
			want: OrphanDelete{LastSeq: 3, Attempt: 1}},
		{name: "an unreadable message decides nothing but moves the sequence",
			evs:  []Fact{requested, ev(2, events.ProxyRetiring, events.SourcePlanner, events.Observer{}), {Seq: 3, Aggregate: events.AggregateProxy, ID: id, Kind: events.ProxyAbandoned, Unreadable: true}},
			want: OrphanDelete{LastSeq: 3, Attempt: 1}},
		{name: "another agent's abandoned is ignored too",
			evs:  []Fact{requested, ev(2, events.ProxyAbandoned, events.AgentSource("local", "t2"), other)},
			want: OrphanDelete{Retire: true, LastSeq: 2, Attempt: 1}},
		{name: "deleted after the inventory was asked for: stale, nothing decided",
			evs:      []Fact{requested, ev(2, events.ProxyRetiring, events.SourcePlanner, events.Observer{}), ev(4, events.ProxyDeleted, agent, placed)},
			listedAt: 3,
			want:     OrphanDelete{Stale: true, LastSeq: 4}},
		{name: "abandoned after the inventory was asked for: stale too",
			evs:      []Fact{requested, ev(5, events.ProxyAbandoned, events.SourcePlanner, events.Observer{})},
			listedAt: 4,
			want:     OrphanDelete{Stale: true, LastSeq: 5}},
		{name: "its last event the last the state held when asked: judged",
			evs:      []Fact{requested, ev(2, events.ProxyRunning, agent, placed), ev(3, events.ProxyDeleted, agent, placed)},
			listedAt: 3,
			want:     OrphanDelete{Retire: true, LastSeq: 3, Attempt: 1}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			listedAt := tc.listedAt
			if listedAt == 0 {
				listedAt = 100 // the inventory was asked for after every event
			}
			if got := DeleteOrphan(o, tc.evs, listedAt); got != tc.want {
				t.Errorf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}
