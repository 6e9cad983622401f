package agent_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/micro"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/agent/agenttest"
	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/bustest"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/testwait"
)

// memDriver is a stateful in-memory backend: instances get an address after
// pollsToRun Get calls, and errors can be queued per operation.
type memDriver struct {
	mu         sync.Mutex
	instances  map[string]*agent.Instance
	creates    map[string]int
	pollsToRun int
	polls      map[string]int
	createErrs []error
	deleteErrs []error
	prepared   map[string]string
	order      []string
	// block makes Create of a proxy wait until the channel is closed.
	block map[string]chan struct{}
	// lists counts List calls.
	lists int
	// blocked records the proxies whose Create is waiting on block.
	blocked map[string]bool
}

func newMemDriver() *memDriver {
	return &memDriver{instances: map[string]*agent.Instance{}, creates: map[string]int{}, polls: map[string]int{}, prepared: map[string]string{}}
}

func (d *memDriver) Create(ctx context.Context, s agent.Spec) (agent.Instance, error) {
	d.mu.Lock()
	wait := d.block[s.ProxyID]
	if wait != nil {
		if d.blocked == nil {
			d.blocked = map[string]bool{}
		}
		d.blocked[s.ProxyID] = true
	}
	d.mu.Unlock()
	if wait != nil {
		select {
		case <-wait:
		case <-ctx.Done():
			return agent.Instance{}, ctx.Err()
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.order = append(d.order, "create:"+s.ProxyID)
	if err := popErr(&d.createErrs); err != nil {
		return agent.Instance{}, err
	}
	d.creates[s.ProxyID]++
	if inst, ok := d.instances[s.Name]; ok {
		return *inst, nil
	}
	inst := &agent.Instance{Name: s.Name, ProviderID: s.ProviderID, Marker: s.Marker(), State: agent.StateProvisioning}
	if d.pollsToRun == 0 {
		inst.State, inst.Address = agent.StateRunning, "127.0.0.1:9"
	}
	d.instances[s.Name] = inst
	return *inst, nil
}

// popErr takes the next of the errors queued in errs: nil when none is.
func popErr(errs *[]error) error {
	if len(*errs) == 0 {
		return nil
	}
	err := (*errs)[0]
	*errs = (*errs)[1:]
	return err
}

func (d *memDriver) Get(ctx context.Context, r agent.Ref) (agent.Instance, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	inst, ok := d.instances[r.Name]
	if !ok {
		return agent.Instance{}, agent.Wrap(agent.ErrNotFound, errors.New("no such instance"))
	}
	d.polls[r.Name]++
	if d.polls[r.Name] >= d.pollsToRun {
		inst.State, inst.Address = agent.StateRunning, "127.0.0.1:9"
	}
	return *inst, nil
}

func (d *memDriver) Delete(ctx context.Context, r agent.Ref) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.order = append(d.order, "delete:"+r.ProxyID)
	if err := popErr(&d.deleteErrs); err != nil {
		return err
	}
	if _, ok := d.instances[r.Name]; !ok {
		return agent.Wrap(agent.ErrNotFound, errors.New("gone"))
	}
	delete(d.instances, r.Name)
	return nil
}

func (d *memDriver) List(ctx context.Context) ([]agent.Instance, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.lists++
	var out []agent.Instance
	for _, i := range d.instances {
		out = append(out, *i)
	}
	return out, nil
}

func (d *memDriver) Check(ctx context.Context) []agent.Verdict {
	return []agent.Verdict{{Check: "memory", OK: true}}
}

// preparingDriver adds the Preparer capability.
type preparingDriver struct{ *memDriver }

func (d preparingDriver) Prepare(ctx context.Context, s agent.Spec) (string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if s.ProviderID != "" {
		return s.ProviderID, nil
	}
	id := fmt.Sprintf("vm-%d", len(d.prepared)+100)
	d.prepared[s.ProxyID] = id
	return id, nil
}

type harness struct {
	t     *testing.T
	conn  *bus.Conn
	store *bus.EventStore
	drv   agent.Driver
}

func start(t *testing.T, drv agent.Driver) *harness {
	t.Helper()
	c := bustest.Start(t)
	h := &harness{t: t, conn: c, store: bus.NewEventStore(c, "test", nil), drv: drv}
	h.run(drv)
	return h
}

func (h *harness) run(drv agent.Driver) context.CancelFunc {
	h.t.Helper()
	rt, err := agent.New(bustest.Dial(h.t, h.conn), drv, agent.Config{
		Info:          agent.Info{Entry: "mem", Target: "t1", Type: "memory"},
		WatchInterval: 10 * time.Millisecond, HeartbeatInterval: 100 * time.Millisecond,
		RecheckInterval: 50 * time.Millisecond,
	}, nil, nil)
	if err != nil {
		h.t.Fatal(err)
	}
	_, stop := agenttest.Serve(h.t, rt.Run)
	return func() { _ = stop() }
}

func (h *harness) create(id string, attempt int) {
	h.t.Helper()
	cmd := events.CreateCommand{ProxyID: id, ProxySpec: events.ProxySpec{Pool: "p", Entry: "mem", Target: "t1", Instance: events.InstanceName(id), Port: 3128}, Attempt: attempt}
	if _, err := bus.PublishCreate(context.Background(), h.conn, "test", cmd, 0); err != nil {
		h.t.Fatal(err)
	}
}

func (h *harness) delete(id string, attempt int) {
	h.t.Helper()
	cmd := events.DeleteCommand{ProxyID: id, Pool: "p", Entry: "mem", Target: "t1", Instance: events.InstanceName(id), Attempt: attempt}
	if _, err := bus.PublishDelete(context.Background(), h.conn, "test", cmd, 0); err != nil {
		h.t.Fatal(err)
	}
}

// waitKinds waits until proxy id's events end with kind and returns them.
func (h *harness) waitFor(id, kind string) []bus.Event {
	h.t.Helper()
	return h.waitForWithin(id, kind, 20*time.Second)
}

// waitForWithin is waitFor with its own deadline.
func (h *harness) waitForWithin(id, kind string, within time.Duration) []bus.Event {
	h.t.Helper()
	var evs []bus.Event
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	err := testwait.For(ctx, func() bool {
		var err error
		if evs, err = h.store.Load(context.Background(), events.AggregateProxy, id); err != nil {
			h.t.Fatal(err)
		}
		return len(evs) > 0 && evs[len(evs)-1].Kind == kind
	})
	if err != nil {
		h.t.Fatalf("proxy %s never reached %s; events: %v", id, kind, kinds(evs))
	}
	return evs
}

// waitCond waits for cond within the 20s these tests allow a condition.
func waitCond(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testwait.Until(t, 20*time.Second, what, cond)
}

func kinds(evs []bus.Event) []string {
	out := make([]string, len(evs))
	for i, e := range evs {
		out[i] = e.Kind
	}
	return out
}

func (h *harness) waitQueueEmpty() {
	h.t.Helper()
	testwait.Until(h.t, 20*time.Second, "the commands to be acknowledged", func() bool {
		s, _ := h.conn.JS.Stream(context.Background(), bus.CommandsStream)
		info, _ := s.Info(context.Background())
		return info.State.Msgs == 0
	})
}

func TestCreatePublishesProvisioningThenRunning(t *testing.T) {
	d := newMemDriver()
	d.pollsToRun = 3
	h := start(t, d)
	h.create("p-1", 1)
	evs := h.waitFor("p-1", events.ProxyRunning)
	if got := kinds(evs); len(got) != 2 || got[0] != events.ProxyProvisioning {
		t.Fatalf("events = %v, want [provisioning running]", got)
	}
	var run events.ProxyRunningData
	if err := evs[1].DecodeData(&run); err != nil || run.Address != "127.0.0.1:9" || run.Attempt != 1 {
		t.Fatalf("running data = %+v, %v", run, err)
	}
	h.waitQueueEmpty()
	// A redelivered or repeated create for a running proxy changes nothing.
	h.create("p-1", 1)
	h.create("p-1", 2)
	h.waitQueueEmpty()
	evs, _ = h.store.Load(context.Background(), events.AggregateProxy, "p-1")
	if len(evs) != 2 {
		t.Fatalf("repeated creates appended events: %v", kinds(evs))
	}
}

func TestErrorClasses(t *testing.T) {
	cases := []struct {
		name      string
		err       error
		wantKind  string
		wantClass string
	}{
		{"transient then success", agent.Wrap(agent.ErrTransient, errors.New("busy")), events.ProxyRunning, ""},
		{"unclassified is transient", errors.New("socket closed"), events.ProxyRunning, ""},
		{"permanent", agent.Wrap(agent.ErrPermanent, errors.New("bad image")), events.ProxyFailed, events.ClassPermanent},
		{"quota", agent.Wrap(agent.ErrQuotaExceeded, errors.New("no cpus")), events.ProxyFailed, events.ClassQuota},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newMemDriver()
			d.createErrs = []error{c.err}
			h := start(t, d)
			id := fmt.Sprintf("e-%d", i)
			h.create(id, 1)
			evs := h.waitFor(id, c.wantKind)
			if c.wantClass != "" {
				var f events.ProxyFailedData
				if err := evs[len(evs)-1].DecodeData(&f); err != nil || f.Class != c.wantClass || f.Attempt != 1 {
					t.Fatalf("failed data = %+v, %v; want class %s", f, err, c.wantClass)
				}
			}
			h.waitQueueEmpty()
		})
	}
}

func TestCreateDroppedWhenRetiring(t *testing.T) {
	d := newMemDriver()
	h := start(t, d)
	if _, err := h.store.Append(context.Background(), events.AggregateProxy, "r-1", events.ProxyRetiring, "r-1.retiring.1", events.ProxyRetiringData{Reason: "x"}, nil); err != nil {
		t.Fatal(err)
	}
	h.create("r-1", 1)
	h.waitQueueEmpty()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.creates["r-1"] != 0 {
		t.Fatalf("driver Create called %d times for a retiring proxy", d.creates["r-1"])
	}
}

// Another agent's word about a proxy decides nothing for this one: a
// running from agent mem/t2 does not make this agent skip a create, nor its
// deleted skip a delete.
func TestOtherAgentsObservationsAreIgnored(t *testing.T) {
	d := newMemDriver()
	h := start(t, d)
	other := bus.NewEventStore(h.conn, events.AgentSource("mem", "t2"), nil)
	if _, err := other.Append(context.Background(), events.AggregateProxy, "x-1", events.ProxyRunning, "x-1.running.forged", events.ProxyRunningData{Address: "127.0.0.1:6666"}, nil); err != nil {
		t.Fatal(err)
	}
	h.create("x-1", 1)
	h.waitFor("x-1", events.ProxyRunning)
	h.waitQueueEmpty()
	d.mu.Lock()
	creates := d.creates["x-1"]
	d.mu.Unlock()
	if creates != 1 {
		t.Fatalf("driver Create called %d times after another agent's running; want 1", creates)
	}
	if _, err := other.Append(context.Background(), events.AggregateProxy, "x-1", events.ProxyDeleted, "x-1.deleted.forged", events.ProxyDeletedData{Attempt: 1}, nil); err != nil {
		t.Fatal(err)
	}
	h.delete("x-1", 1)
	h.waitQueueEmpty()
	own, err := h.store.LastObservation(context.Background(), "x-1", events.ProxyDeleted, events.Observer{Entry: "mem", Target: "t1"})
	if err != nil || own == nil || own.Source != events.AgentSource("mem", "t1") {
		evs, _ := h.store.Load(context.Background(), events.AggregateProxy, "x-1")
		t.Fatalf("this agent's deleted = %+v, %v; want one (events %v)", own, err, kinds(evs))
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.instances) != 0 {
		t.Fatalf("instances left after the delete: %v", d.instances)
	}
}

func TestCommandsForOneProxyRunInOrder(t *testing.T) {
	d := newMemDriver()
	d.pollsToRun = 5
	h := start(t, d)
	h.create("o-1", 1)
	h.delete("o-1", 1)
	evs := h.waitFor("o-1", events.ProxyDeleted)
	if got := kinds(evs); len(got) != 3 || got[1] != events.ProxyRunning {
		t.Fatalf("events = %v, want [provisioning running deleted]", got)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.instances) != 0 {
		t.Fatalf("instances left: %v", d.instances)
	}
}

func TestDeleteOfMissingInstanceIsDeleted(t *testing.T) {
	h := start(t, newMemDriver())
	h.delete("gone-1", 1)
	h.waitFor("gone-1", events.ProxyDeleted)
	h.waitQueueEmpty()
}

func TestDeleteTransientErrorIsRetried(t *testing.T) {
	d := newMemDriver()
	d.deleteErrs = []error{agent.Wrap(agent.ErrTransient, errors.New("lock timeout"))}
	h := start(t, d)
	h.delete("dt-1", 1)
	h.waitFor("dt-1", events.ProxyDeleted)
	d.mu.Lock()
	defer d.mu.Unlock()
	if n := len(d.order); n != 2 {
		t.Fatalf("driver calls %v, want two deletes", d.order)
	}
}

func TestPreparerProviderIDRecordedBeforeCreate(t *testing.T) {
	d := preparingDriver{newMemDriver()}
	h := start(t, d)
	h.create("v-1", 1)
	evs := h.waitFor("v-1", events.ProxyRunning)
	var prov events.ProxyProvisioningData
	if err := evs[0].DecodeData(&prov); err != nil || prov.ProviderID != "vm-100" {
		t.Fatalf("provisioning = %+v, %v; want provider id vm-100", prov, err)
	}
}

func TestResumeWatchesUnfinishedInstances(t *testing.T) {
	d := newMemDriver()
	d.pollsToRun = 2
	// The instance exists and the log says provisioning, as if the agent
	// crashed after Create and before running was published.
	d.instances[events.InstanceName("res-1")] = &agent.Instance{Name: events.InstanceName("res-1"), Marker: agent.Marker{ProxyID: "res-1", Pool: "p", Entry: "mem"}, State: agent.StateProvisioning}
	c := bustest.Start(t)
	s := bus.NewEventStore(c, "test", nil)
	if _, err := s.Append(context.Background(), events.AggregateProxy, "res-1", events.ProxyProvisioning, "res-1.provisioning.1",
		events.ProxyProvisioningData{Entry: "mem", Target: "t1", Instance: events.InstanceName("res-1"), Attempt: 1}, nil); err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, conn: c, store: s, drv: d}
	h.run(d)
	h.waitFor("res-1", events.ProxyRunning)
}

func TestServiceEndpointsAndHeartbeat(t *testing.T) {
	d := newMemDriver()
	h := start(t, d)
	h.create("s-1", 1)
	h.waitFor("s-1", events.ProxyRunning)
	for _, verb := range []string{events.AgentInfo, events.AgentInventory, events.AgentCheck} {
		msg, err := h.conn.NC.Request(events.AgentSubject("mem", "t1", verb), nil, 5*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", verb, err)
		}
		switch verb {
		case events.AgentInfo:
			var info agent.Info
			if err := json.Unmarshal(msg.Data, &info); err != nil || info.Entry != "mem" || info.Type != "memory" {
				t.Fatalf("info = %s", msg.Data)
			}
		case events.AgentInventory:
			var inv agent.Inventory
			if err := json.Unmarshal(msg.Data, &inv); err != nil || len(inv.Instances) != 1 || inv.Instances[0].Marker.ProxyID != "s-1" || inv.Next != "" {
				t.Fatalf("inventory = %s", msg.Data)
			}
		case events.AgentCheck:
			var v []agent.Verdict
			if err := json.Unmarshal(msg.Data, &v); err != nil || len(v) != 1 || !v[0].OK {
				t.Fatalf("check = %s", msg.Data)
			}
		}
	}
	kv, err := h.conn.JS.KeyValue(context.Background(), bus.BucketAgents)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		e, err := kv.Get(context.Background(), agent.HeartbeatKey("mem", "t1"))
		if err == nil {
			var hb agent.Heartbeat
			if err := json.Unmarshal(e.Value(), &hb); err == nil && hb.Instances == 1 {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no heartbeat with 1 instance: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestClassify(t *testing.T) {
	base := errors.New("upstream said no")
	cases := []struct {
		err  error
		want string
	}{
		{nil, ""},
		{base, agent.ClassTransient},
		{agent.Wrap(agent.ErrNotFound, base), agent.ClassNotFound},
		{agent.Wrap(agent.ErrQuotaExceeded, base), agent.ClassQuota},
		{agent.Wrap(agent.ErrPermanent, base), agent.ClassPermanent},
		{fmt.Errorf("context: %w", agent.Wrap(agent.ErrPermanent, base)), agent.ClassPermanent},
		{agent.Wrap(agent.ErrTransient, agent.Wrap(agent.ErrPermanent, base)), agent.ClassTransient},
	}
	for _, c := range cases {
		if got := agent.Classify(c.err); got != c.want {
			t.Errorf("Classify(%v) = %q, want %q", c.err, got, c.want)
		}
	}
	if err := agent.Wrap(agent.ErrPermanent, base); !errors.Is(err, base) || err.Error() != base.Error() {
		t.Errorf("Wrap lost the upstream error: %v", err)
	}
}

// TestStuckProxyDoesNotStallOthers is invariant 6 at the runtime: a create
// stuck in its backend call holds up only its own proxy.
func TestStuckProxyDoesNotStallOthers(t *testing.T) {
	d := newMemDriver()
	release := make(chan struct{})
	d.block = map[string]chan struct{}{"stuck-1": release}
	h := start(t, d)
	h.create("stuck-1", 1)
	h.delete("stuck-1", 1) // queued behind the stuck create of the same proxy
	for i := 0; i < 3; i++ {
		h.create(fmt.Sprintf("free-%d", i), 1)
	}
	for i := 0; i < 3; i++ {
		h.waitFor(fmt.Sprintf("free-%d", i), events.ProxyRunning)
	}
	evs, _ := h.store.Load(context.Background(), events.AggregateProxy, "stuck-1")
	if got := kinds(evs); len(got) != 1 || got[0] != events.ProxyProvisioning {
		t.Fatalf("stuck proxy events = %v, want only [provisioning] while its create is stuck", got)
	}
	close(release)
	evs = h.waitFor("stuck-1", events.ProxyDeleted)
	if got := kinds(evs); len(got) != 3 || got[1] != events.ProxyRunning {
		t.Fatalf("stuck proxy events = %v, want [provisioning running deleted]", got)
	}
}

// TestQueuedCommandIsNotRedelivered: a delete waiting in its proxy's queue
// behind a create that takes 60 s (four times the consumer's AckWait) is
// kept alive from the moment it is taken, so JetStream delivers each
// command exactly once and both complete.
func TestQueuedCommandIsNotRedelivered(t *testing.T) {
	if testing.Short() {
		t.Skip("takes 60 s")
	}
	d := newMemDriver()
	release := make(chan struct{})
	d.block = map[string]chan struct{}{"slow-1": release}
	h := start(t, d)
	h.create("slow-1", 1)
	h.delete("slow-1", 1)
	waitCond(t, "the create to block in the driver", func() bool {
		d.mu.Lock()
		defer d.mu.Unlock()
		return d.blocked["slow-1"]
	})
	slow := time.AfterFunc(60*time.Second, func() { close(release) })
	defer slow.Stop()
	evs := h.waitForWithin("slow-1", events.ProxyDeleted, 90*time.Second)
	if got := kinds(evs); len(got) != 3 || got[1] != events.ProxyRunning {
		t.Fatalf("events = %v, want [provisioning running deleted]", got)
	}
	h.waitQueueEmpty()
	cons, err := h.conn.JS.Consumer(context.Background(), bus.CommandsStream, bus.AgentConsumerName("mem", "t1"))
	if err != nil {
		t.Fatal(err)
	}
	info, err := cons.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// The consumer sequence counts every delivery, redeliveries included.
	if info.Delivered.Consumer != 2 || info.NumRedelivered != 0 {
		t.Fatalf("consumer delivered %d times (%d redelivered) for 2 commands; want exactly 2", info.Delivered.Consumer, info.NumRedelivered)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if got := strings.Join(d.order, " "); got != "create:slow-1 delete:slow-1" {
		t.Fatalf("driver calls %q, want one create then one delete", got)
	}
}

// TestInventoryIsPaged: the inventory answers pages in name order that a
// walk by "next" covers exactly once, and refuses a malformed request.
func TestInventoryIsPaged(t *testing.T) {
	d := newMemDriver()
	h := start(t, d)
	var want []string
	for _, id := range []string{"p-3", "p-1", "p-5", "p-2", "p-4"} {
		h.create(id, 1)
		h.waitFor(id, events.ProxyRunning)
		want = append(want, events.InstanceName(id))
	}
	slices.Sort(want)
	subject := events.AgentSubject("mem", "t1", events.AgentInventory)
	var got []string
	after := ""
	for pages := 0; ; pages++ {
		if pages > len(want) {
			t.Fatalf("walk did not end after %d pages: %v", pages, got)
		}
		body, _ := json.Marshal(map[string]any{"limit": 2, "after": after})
		msg, err := h.conn.NC.Request(subject, body, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		var inv agent.Inventory
		if err := json.Unmarshal(msg.Data, &inv); err != nil || len(inv.Instances) > 2 {
			t.Fatalf("page after %q = %s (%v); want at most 2 instances", after, msg.Data, err)
		}
		for _, i := range inv.Instances {
			got = append(got, i.Name)
		}
		if inv.Next == "" {
			break
		}
		after = inv.Next
	}
	if !slices.Equal(got, want) {
		t.Errorf("walk = %v, want %v", got, want)
	}
	for _, bad := range []string{`{"limit":-1}`, `{"limti":2}`, `[`} {
		msg, err := h.conn.NC.Request(subject, []byte(bad), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if code := msg.Header.Get(micro.ErrorCodeHeader); code != "400" {
			t.Errorf("inventory %s: code %q (%s), want 400", bad, code, msg.Data)
		}
	}
}
