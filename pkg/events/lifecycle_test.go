package events

import (
	"slices"
	"testing"
)

// TestTransitionTable writes down every pair (state × event). A cell is the
// state after the event, or "-" when the event is ignored in that state.
// A cell equal to its row's state (other than "-") means the event's data is
// recorded while the state stays.
func TestTransitionTable(t *testing.T) {
	const x = "-"
	// Columns, in this order.
	cols := []string{ProxyRequested, ProxyProvisioning, ProxyRunning, ProxyReady, ProxyUnhealthy,
		ProxyFailed, ProxyRetiring, ProxyDeleted, ProxyAbandoned, ProxyDisabled, "exploded"}
	rows := []struct {
		from string
		to   []string
		why  string
	}{
		{"", []string{ProxyRequested, x, x, x, x, x, x, x, x, x, x},
			"only requested creates a proxy; an observation of a proxy nobody requested (or one the garbage collector retires) never enters state"},
		{ProxyRequested, []string{ProxyRequested, ProxyProvisioning, ProxyRunning, ProxyReady, ProxyUnhealthy, ProxyFailed, ProxyRetiring, ProxyDeleted, ProxyAbandoned, ProxyDisabled, x},
			"a re-issued requested is a new attempt of the same create; every observation moves an active proxy; failed, retiring, deleted and abandoned end it"},
		{ProxyProvisioning, []string{x, ProxyProvisioning, ProxyRunning, ProxyReady, ProxyUnhealthy, ProxyFailed, ProxyRetiring, ProxyDeleted, ProxyAbandoned, ProxyDisabled, x},
			"a requested after the create started is a stale decision; provisioning again is the agent's next attempt"},
		{ProxyRunning, []string{x, ProxyProvisioning, ProxyRunning, ProxyReady, ProxyUnhealthy, ProxyFailed, ProxyRetiring, ProxyDeleted, ProxyAbandoned, ProxyDisabled, x},
			"provisioning after running is a re-created instance (the view keeps the address); health's probes decide ready or unhealthy"},
		{ProxyReady, []string{x, ProxyProvisioning, ProxyRunning, ProxyReady, ProxyUnhealthy, ProxyFailed, ProxyRetiring, ProxyDeleted, ProxyAbandoned, ProxyDisabled, x},
			"ready ⇄ unhealthy; a late running or provisioning makes health probe it again"},
		{ProxyUnhealthy, []string{x, ProxyProvisioning, ProxyRunning, ProxyReady, ProxyUnhealthy, ProxyFailed, ProxyRetiring, ProxyDeleted, ProxyAbandoned, ProxyDisabled, x},
			"unhealthy ⇄ ready; the planner fails or retires a proxy unhealthy too long"},
		{ProxyFailed, []string{x, ProxyFailed, ProxyFailed, x, x, x, ProxyRetiring, ProxyDeleted, ProxyAbandoned, x, x},
			"failed is a decision: a late provisioning or running is recorded (provider id, address: the delete needs them) but never revives the proxy; late probes are ignored; the first failure stands; the planner retires it"},
		{ProxyRetiring, []string{x, ProxyRetiring, ProxyRetiring, x, x, x, ProxyRetiring, ProxyDeleted, ProxyAbandoned, x, x},
			"retiring is a decision: a create finishing late is recorded but the proxy stays retiring; a failure is ignored (it is on its way out); a re-issued retiring is a new delete attempt"},
		{ProxyDisabled, []string{x, x, x, ProxyReady, x, ProxyFailed, ProxyRetiring, ProxyDeleted, ProxyAbandoned, ProxyDisabled, x},
			"disabled (an external proxy out of service) ends with ready (health: its time passed and a probe succeeded) or a decision that ends it; a re-issued disabled sets a new time; other observations are ignored"},
		{ProxyDeleted, []string{x, x, x, x, x, x, x, x, x, x, x},
			"terminal: absorbs everything, a requested included (proxy ids are never reused)"},
		{ProxyAbandoned, []string{x, x, x, x, x, x, x, x, x, x, x},
			"terminal: absorbs everything"},
	}
	if got := len(rows); got != len(ProxyStates())+1 {
		t.Fatalf("table has %d rows; want one per state and one for no state (%d)", got, len(ProxyStates())+1)
	}
	for _, r := range rows {
		for i, ev := range cols {
			to, ok := Transition(r.from, ev)
			want, wantOK := r.to[i], r.to[i] != x
			if !wantOK {
				want = r.from
			}
			if to != want || ok != wantOK {
				t.Errorf("Transition(%q, %q) = (%q, %v); want (%q, %v): %s", r.from, ev, to, ok, want, wantOK, r.why)
			}
		}
	}
	// An unknown state absorbs everything too: a reader never guesses.
	for _, ev := range cols {
		if to, ok := Transition("exploded", ev); to != "exploded" || ok {
			t.Errorf("Transition(%q, %q) = (%q, %v); want (%q, false)", "exploded", ev, to, ok, "exploded")
		}
	}
}

// No sequence of events leaves a terminal state, and none leaves failed or
// retiring for an active state: late observations never revive a proxy.
func TestTransitionNeverRevives(t *testing.T) {
	active := []string{ProxyRequested, ProxyProvisioning, ProxyRunning, ProxyReady, ProxyUnhealthy}
	for _, from := range ProxyStates() {
		for _, ev := range ProxyStates() {
			to, _ := Transition(from, ev)
			if IsTerminal(from) && to != from {
				t.Errorf("Transition(%q, %q) = %q; a terminal state must absorb every event", from, ev, to)
			}
			if (from == ProxyFailed || from == ProxyRetiring) && slices.Contains(active, to) {
				t.Errorf("Transition(%q, %q) = %q; a decided proxy must never become active again", from, ev, to)
			}
		}
	}
}

func TestWriters(t *testing.T) {
	tests := []struct {
		aggregate, typ string
		want           []string
	}{
		{AggregateProxy, ProxyRequested, []string{WriterPlanner}},
		{AggregateProxy, ProxyProvisioning, []string{WriterAgent}},
		{AggregateProxy, ProxyRunning, []string{WriterAgent}},
		{AggregateProxy, ProxyReady, []string{WriterHealth}},
		{AggregateProxy, ProxyUnhealthy, []string{WriterHealth}},
		{AggregateProxy, ProxyFailed, []string{WriterPlanner, WriterAgent}},
		{AggregateProxy, ProxyRetiring, []string{WriterPlanner}},
		{AggregateProxy, ProxyDeleted, []string{WriterAgent}},
		{AggregateProxy, ProxyAbandoned, []string{WriterPlanner}},
		{AggregatePool, PoolApplied, []string{WriterPlanner}},
		{AggregatePool, PoolDeleted, []string{WriterPlanner}},
		{AggregateProxy, "exploded", nil},
		{AggregatePool, ProxyRunning, nil},
		{"target", PoolApplied, nil},
	}
	for _, tt := range tests {
		if got := Writers(tt.aggregate, tt.typ); !slices.Equal(got, tt.want) {
			t.Errorf("Writers(%q, %q) = %q; want %q", tt.aggregate, tt.typ, got, tt.want)
		}
	}
}

func TestWriterOf(t *testing.T) {
	tests := []struct {
		source, want string
	}{
		{"proxyfleet/planner", WriterPlanner},
		{"proxyfleet/health", WriterHealth},
		{"proxyfleet/agent/kvm-home/node1", WriterAgent},
		{AgentSource("local", "laptop"), WriterAgent},
		{"proxyfleet/agent/kvm-home", ""},
		{"proxyfleet/agent/kvm-home/node1/extra", ""},
		{"proxyfleet/agent/KVM/node1", ""},
		{"proxyfleet/agent//node1", ""},
		{"proxyfleet/planner/x", ""},
		{"test", ""},
		{"", ""},
	}
	for _, tt := range tests {
		if got := WriterOf(tt.source); got != tt.want {
			t.Errorf("WriterOf(%q) = %q; want %q", tt.source, got, tt.want)
		}
	}
}

func TestCheckEvent(t *testing.T) {
	agent := AgentSource("local", "laptop")
	tests := []struct {
		name                       string
		aggregate, id, typ, source string
		field                      string // "" when the event is accepted
		on                         string // the subject; "" for the one source writes on
	}{
		{"planner requests", AggregateProxy, "demo-abc", ProxyRequested, SourcePlanner, "", ""},
		{"agent requests", AggregateProxy, "demo-abc", ProxyRequested, agent, "source", ""},
		{"agent runs", AggregateProxy, "demo-abc", ProxyRunning, agent, "", ""},
		{"health runs", AggregateProxy, "demo-abc", ProxyRunning, SourceHealth, "source", ""},
		{"health ready", AggregateProxy, "demo-abc", ProxyReady, SourceHealth, "", ""},
		{"agent ready", AggregateProxy, "demo-abc", ProxyReady, agent, "source", ""},
		{"agent fails", AggregateProxy, "demo-abc", ProxyFailed, agent, "", ""},
		{"planner fails", AggregateProxy, "demo-abc", ProxyFailed, SourcePlanner, "", ""},
		{"health fails", AggregateProxy, "demo-abc", ProxyFailed, SourceHealth, "source", ""},
		{"agent retires", AggregateProxy, "demo-abc", ProxyRetiring, agent, "source", ""},
		{"planner deletes", AggregateProxy, "demo-abc", ProxyDeleted, SourcePlanner, "source", ""},
		{"agent abandons", AggregateProxy, "demo-abc", ProxyAbandoned, agent, "source", ""},
		{"unknown source", AggregateProxy, "demo-abc", ProxyRetiring, "test", "source", ""},
		{"unknown type is not checked", AggregateProxy, "demo-abc", "exploded", "test", "", ""},
		{"planner applies a pool", AggregatePool, "demo", PoolApplied, SourcePlanner, "", ""},
		{"agent applies a pool", AggregatePool, "demo", PoolApplied, agent, "source", ""},
		{"upper-case id", AggregateProxy, "Demo-abc", ProxyRequested, SourcePlanner, "id", ""},
		{"underscore id", AggregateProxy, "demo_abc", ProxyRunning, agent, "id", ""},
		{"id of 64 characters", AggregateProxy, "a123456789012345678901234567890123456789012345678901234567890123", ProxyRequested, SourcePlanner, "id", ""},
		{"pool id with a trailing dash", AggregatePool, "demo-", PoolApplied, SourcePlanner, "id", ""},
		{"another aggregate is its readers' business", "planner", "Replica_1", "term", "test", "", ""},
		{"agent fails on its subject", AggregateProxy, "demo-abc", ProxyFailed, agent, "", "fleet.evt.proxy.demo-abc.failed.local.laptop"},
		{"agent runs on a decision's subject", AggregateProxy, "demo-abc", ProxyRunning, agent, "subject", "fleet.evt.proxy.demo-abc.running"},
		{"agent deletes on a decision's subject", AggregateProxy, "demo-abc", ProxyDeleted, agent, "subject", "fleet.evt.proxy.demo-abc.deleted"},
		{"agent runs on another agent's subject", AggregateProxy, "demo-abc", ProxyRunning, agent, "source", "fleet.evt.proxy.demo-abc.running.local.other"},
		{"forged source on an agent's subject", AggregateProxy, "demo-abc", ProxyRunning, AgentSource("local", "other"), "source", "fleet.evt.proxy.demo-abc.running.local.laptop"},
		{"planner fails on an agent's subject", AggregateProxy, "demo-abc", ProxyFailed, SourcePlanner, "source", "fleet.evt.proxy.demo-abc.failed.local.laptop"},
		{"planner requests on an agent's subject", AggregateProxy, "demo-abc", ProxyRequested, SourcePlanner, "source", "fleet.evt.proxy.demo-abc.requested.local.laptop"},
		{"health ready on an agent's subject", AggregateProxy, "demo-abc", ProxyReady, SourceHealth, "source", "fleet.evt.proxy.demo-abc.ready.local.laptop"},
		{"subject's agent breaks the identifier rule", AggregateProxy, "demo-abc", "exploded", agent, "subject", "fleet.evt.proxy.demo-abc.exploded.Local.laptop"},
		{"unknown type from an agent on a decision's subject", AggregateProxy, "demo-abc", "exploded", agent, "subject", "fleet.evt.proxy.demo-abc.exploded"},
	}
	for _, tt := range tests {
		on := tt.on
		if on == "" {
			on = SubjectOf(tt.source, tt.aggregate, tt.id, tt.typ)
		}
		_, _, _, by, ok := ParseEventSubject(on)
		if !ok {
			t.Fatalf("%s: ParseEventSubject(%q) refused the subject", tt.name, on)
		}
		fe := CheckEvent(tt.aggregate, tt.id, tt.typ, tt.source, by)
		got := ""
		if fe != nil {
			got = fe.Field
		}
		if got != tt.field {
			t.Errorf("%s: CheckEvent(%q, %q, %q, %q, %v) on %s = %v; want a problem with field %q", tt.name, tt.aggregate, tt.id, tt.typ, tt.source, by, on, fe, tt.field)
		}
	}
}

func TestCheckPlacement(t *testing.T) {
	tests := []struct {
		name  string
		by    Observer
		field string
	}{
		{"no agent: a decision or health's observation", Observer{}, ""},
		{"the agent the proxy was placed on", Observer{"local", "t1"}, ""},
		{"another target of the same entry", Observer{"local", "t2"}, "subject"},
		{"another entry with the same target name", Observer{"kvm", "t1"}, "subject"},
	}
	for _, tt := range tests {
		fe := CheckPlacement(tt.by, "local", "t1")
		got := ""
		if fe != nil {
			got = fe.Field
		}
		if got != tt.field {
			t.Errorf("%s: CheckPlacement(%v, local, t1) = %v; want a problem with field %q", tt.name, tt.by, fe, tt.field)
		}
	}
}

func TestParseAgentSource(t *testing.T) {
	if by, ok := ParseAgentSource(AgentSource("kvm-home", "node1")); !ok || by != (Observer{"kvm-home", "node1"}) {
		t.Errorf("ParseAgentSource(AgentSource(kvm-home, node1)) = %v, %v", by, ok)
	}
	for _, bad := range []string{SourcePlanner, SourceHealth, "proxyfleet/agent/kvm-home", "proxyfleet/agent/KVM/node1", "proxyfleet/agent/a/b/c", ""} {
		if by, ok := ParseAgentSource(bad); ok {
			t.Errorf("ParseAgentSource(%q) = %v; want no agent", bad, by)
		}
	}
}

func TestCheckProxyData(t *testing.T) {
	tests := []struct {
		typ, data string
		ok        bool
	}{
		{ProxyRequested, `{"pool":"demo","entry":"local","target":"t1","instance":"px-a","revision":1,"port":3128}`, true},
		{ProxyRequested, `{"pool":"BAD NAME","entry":"local","target":"t1","instance":"px-a"}`, false},
		{ProxyProvisioning, `{"attempt":1}`, true},
		{ProxyProvisioning, `{"attempt":"one"}`, false},
		{ProxyRunning, `{"address":"127.0.0.1:1","attempt":1,"zone":"added by a newer writer"}`, true},
		{ProxyRunning, `{"attempt":1}`, false},
		{ProxyReady, `{"address":"127.0.0.1:1","latencyMs":3}`, true},
		{ProxyReady, `{"latencyMs":"fast"}`, false},
		{ProxyUnhealthy, `{"reason":"refused","streak":3}`, true},
		{ProxyFailed, `{"class":"quota","reason":"full"}`, true},
		{ProxyFailed, `{"class":5}`, false},
		{ProxyRetiring, `{"reason":"scale down"}`, true},
		{ProxyRetiring, `[1,2]`, false},
		{ProxyDeleted, `{"attempt":1}`, true},
		{ProxyDeleted, ``, false},
		{ProxyAbandoned, `{"reason":"skip cleanup"}`, true},
		{"exploded", `nonsense`, true},
	}
	for _, tt := range tests {
		e := Envelope{Type: EnvelopeType(AggregateProxy, tt.typ), Data: []byte(tt.data)}
		if err := CheckProxyData(tt.typ, e); (err == nil) != tt.ok {
			t.Errorf("CheckProxyData(%s, %s) = %v; want ok=%v", tt.typ, tt.data, err, tt.ok)
		}
	}
}
