package proxmox_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/proxmox-agent/internal/pve"
	"proxyfleet/services/proxmox-agent/internal/pve/pvetest"
)

func TestLifecycle(t *testing.T) {
	e := newEnv(t, pvetest.Options{NextIDAsString: true})
	d := e.driver()
	ctx := ctxT(t, 30*time.Second)
	s := spec("web-aaaaaaaaaa")

	s = prepared(ctx, t, d, s)
	id := s.ProviderID
	inst, err := d.Create(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	if inst.State != agent.StateProvisioning || inst.ProviderID != id {
		t.Errorf("Create = %+v, want provisioning with provider ID %s", inst, id)
	}
	ref := agent.Ref{ProxyID: s.ProxyID, Name: s.Name, ProviderID: id}
	got := waitRunning(t, ctx, d, ref)
	vmid, _ := strconv.Atoi(id)
	if want := pvetest.GuestAddress(vmid) + ":3128"; got.Address != want {
		t.Errorf("address = %q, want %q (from the guest agent)", got.Address, want)
	}
	if got.Marker != s.Marker() {
		t.Errorf("marker = %+v, want %+v", got.Marker, s.Marker())
	}

	vms := e.fake.VMs()
	if len(vms) != 1 {
		t.Fatalf("%d VMs, want 1", len(vms))
	}
	c := vms[0].Conf
	for key, want := range map[string]string{
		"name":   s.Name,
		"cores":  "2",
		"memory": "768",
		"agent":  "1",
		"tags":   "proxyfleet;pf-entry-pve-home;pf-pool-web;pf-proxy-web-aaaaaaaaaa",
	} {
		if c[key] != want {
			t.Errorf("config %s = %q, want %q", key, c[key], want)
		}
	}
	if want := "proxy-seeds:iso/" + s.Name + ".iso,media=cdrom,size="; !strings.HasPrefix(c["ide2"], want) {
		t.Errorf("ide2 = %q, want %q…", c["ide2"], want)
	}
	if want := "virtio=BC:24:11:00:00:01,bridge=vmbr0,firewall=1,tag=4"; c["net0"] != want {
		t.Errorf("net0 = %q, want %q (the clone's NIC and options, on vmbr0 with tag 4)", c["net0"], want)
	}
	if !strings.Contains(c["description"], "proxyfleet.proxy: web-aaaaaaaaaa") || strings.Contains(c["description"], "secret-pw") {
		t.Errorf("description = %q", c["description"])
	}
	if got := e.fake.Volumes(node, "proxy-seeds"); len(got) != 1 {
		t.Errorf("seeds = %v, want one", got)
	}
	list, err := d.List(ctx)
	if err != nil || len(list) != 1 || list[0].Marker != s.Marker() || list[0].ProviderID != id {
		t.Errorf("List = %+v, %v", list, err)
	}

	// Create again (a redelivered command) changes nothing.
	if _, err := d.Create(ctx, s); err != nil {
		t.Fatal(err)
	}
	uploads := 0
	for _, call := range e.fake.Calls() {
		if call.Route == "/nodes/{node}/storage/{storage}/upload" {
			uploads++
		}
	}
	if e.fake.Clones() != 1 || uploads != 1 {
		t.Errorf("after a repeated create: %d clones, %d seed uploads; want 1 and 1", e.fake.Clones(), uploads)
	}

	if err := d.Delete(ctx, ref); err != nil {
		t.Fatal(err)
	}
	if vms := e.fake.VMs(); len(vms) != 0 {
		t.Errorf("VMs after delete: %+v", vms)
	}
	if got := e.fake.Volumes(node, "proxy-seeds"); len(got) != 0 {
		t.Errorf("seeds after delete: %v", got)
	}
	if keys := e.reservations(); len(keys) != 0 {
		t.Errorf("VMID reservations after delete: %v", keys)
	}
}

func TestTwoAgentsCreateTwentyProxiesOnOneNode(t *testing.T) {
	e := newEnv(t, pvetest.Options{NextIDAsString: true, TaskTicks: 4})
	d1, d2 := e.driver(), e.driver()
	ctx := ctxT(t, 90*time.Second)
	const n = 20
	var wg sync.WaitGroup
	var races atomic.Int32
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		d := d1
		if i%2 == 1 {
			d = d2
		}
		s := spec(fmt.Sprintf("web-%010d", i))
		wg.Add(1)
		go func() {
			defer wg.Done()
			id, err := d.Prepare(ctx, s)
			if err != nil {
				errs <- fmt.Errorf("%s prepare: %w", s.ProxyID, err)
				return
			}
			s.ProviderID = id
			for {
				_, err = d.Create(ctx, s)
				if err == nil || agent.Classify(err) != agent.ClassTransient || ctx.Err() != nil {
					break
				}
				// A transient failure is retried as the runtime would.
				if errors.Is(err, pve.ErrVMIDTaken) {
					races.Add(1)
					if s.ProviderID, err = d.Prepare(ctx, s); err != nil {
						break
					}
				}
			}
			if err != nil {
				errs <- fmt.Errorf("%s create: %w", s.ProxyID, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	vms := e.fake.VMs()
	if len(vms) != n {
		t.Fatalf("%d VMs, want %d", len(vms), n)
	}
	seen := map[int]bool{}
	for _, v := range vms {
		if seen[v.VMID] {
			t.Errorf("VMID %d used twice", v.VMID)
		}
		seen[v.VMID] = true
	}
	for i := 0; i < n; i++ {
		p := fmt.Sprintf("web-%010d", i)
		e.wantOneVM(p)
	}
	// The reservations must have kept the agents apart: every clone
	// request was accepted, none lost a race for its VMID.
	cloneCalls := 0
	for _, c := range e.fake.Calls() {
		if c.Route == "/nodes/{node}/qemu/{vmid}/clone" {
			cloneCalls++
		}
	}
	if e.fake.Clones() != n || cloneCalls != n || races.Load() != 0 {
		t.Errorf("clones accepted %d, requested %d, VMID races %d; want %d, %d, 0", e.fake.Clones(), cloneCalls, races.Load(), n, n)
	}
}

func TestCrashAfterCloneStartedMakesNoSecondClone(t *testing.T) {
	e := newEnv(t, pvetest.Options{TaskTicks: 12})
	s := spec("web-crashcrash")
	ctx := ctxT(t, 30*time.Second)

	first := e.driver()
	id, err := first.Prepare(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	s.ProviderID = id // the runtime records it in the provisioning event here
	crashCtx, crash := context.WithCancel(ctx)
	go func() {
		for e.fake.Clones() == 0 && crashCtx.Err() == nil {
			time.Sleep(time.Millisecond)
		}
		crash()
	}()
	if _, err := first.Create(crashCtx, s); err == nil {
		t.Fatal("Create finished before the crash; the test needs the clone task still running")
	}
	crash()

	// After the restart the VM is still being cloned: in progress, not gone.
	second := e.driver()
	ref := agent.Ref{ProxyID: s.ProxyID, Name: s.Name, ProviderID: id}
	inst, err := second.Get(ctx, ref)
	if err != nil || inst.State != agent.StateProvisioning {
		t.Fatalf("Get during the clone = %+v, %v; want provisioning", inst, err)
	}
	again, err := second.Prepare(ctx, s)
	if err != nil || again != id {
		t.Fatalf("Prepare after restart = %q, %v; want the recorded VMID %s", again, err, id)
	}
	if _, err := second.Create(ctx, s); err != nil {
		t.Fatal(err)
	}
	waitRunning(t, ctx, second, ref)
	if c := e.fake.Clones(); c != 1 {
		t.Errorf("clones = %d, want 1", c)
	}
	e.wantOneVM(s.ProxyID)
}

func TestLostProvisioningEventReusesTheReservation(t *testing.T) {
	e := newEnv(t, pvetest.Options{})
	d := e.driver()
	ctx := ctxT(t, 30*time.Second)
	s := spec("web-lostevent1")
	id, err := d.Prepare(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	// The agent died before the provisioning event was stored: the retry
	// has no provider ID, and must find the reservation it made.
	again, err := e.driver().Prepare(ctx, s)
	if err != nil || again != id {
		t.Fatalf("Prepare without a provider ID = %q, %v; want %s", again, err, id)
	}
	if keys := e.reservations(); len(keys) != 2 {
		t.Errorf("reservations = %v, want one VMID and one index", keys)
	}
}

func TestStaleVMIDIsNeverDestroyed(t *testing.T) {
	for _, tc := range []struct {
		name string
		conf map[string]string
	}{
		{"unmarked VM", map[string]string{"description": "someone's database"}},
		{"another proxy's VM", map[string]string{"description": "proxyfleet instance\nproxyfleet.proxy: web-other00000\nproxyfleet.pool: web\nproxyfleet.entry: pve-home\n",
			"tags": "proxyfleet;pf-entry-pve-home;pf-pool-web;pf-proxy-web-other00000"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, pvetest.Options{})
			d := e.driver()
			ctx := ctxT(t, 30*time.Second)
			s := spec("web-staleaaaaa")
			// The proxy once had VMID 150; now another VM lives there.
			e.fake.AddVM(node, 150, "db-1", tc.conf)
			if _, err := e.kv.Create(ctx, "pve-home.150", []byte(s.ProxyID)); err != nil {
				t.Fatal(err)
			}
			ref := agent.Ref{ProxyID: s.ProxyID, Name: s.Name, ProviderID: "150"}
			if err := d.Delete(ctx, ref); err != nil {
				t.Fatalf("Delete: %v", err)
			}
			vms := e.fake.VMs()
			if len(vms) != 1 || vms[0].VMID != 150 {
				t.Fatalf("VMs after delete = %+v; the foreign VM must stay", vms)
			}
			if keys := e.reservations(); len(keys) != 0 {
				t.Errorf("our stale reservation was kept: %v", keys)
			}
			if _, err := d.Get(ctx, ref); !errors.Is(err, agent.ErrNotFound) {
				t.Errorf("Get of a VMID holding another VM: %v, want not found", err)
			}
			for _, c := range e.fake.Calls() {
				if c.Method == "DELETE" && c.Route == "/nodes/{node}/qemu/{vmid}" || c.Route == "/nodes/{node}/qemu/{vmid}/status/stop" {
					t.Errorf("the driver sent %s %s to a VM that is not ours", c.Method, c.Route)
				}
			}
		})
	}
}

func TestVMIDRaceRetriesWithAnotherID(t *testing.T) {
	e := newEnv(t, pvetest.Options{})
	d := e.driver()
	ctx := ctxT(t, 30*time.Second)
	s := prepared(ctx, t, d, spec("web-raceraceaa"))
	id := s.ProviderID
	e.fake.RaceNextClone()
	_, err := d.Create(ctx, s)
	if !errors.Is(err, pve.ErrVMIDTaken) || agent.Classify(err) != agent.ClassTransient {
		t.Fatalf("Create losing the VMID race: %v, want a transient ErrVMIDTaken", err)
	}
	next, err := d.Prepare(ctx, s)
	if err != nil || next == id {
		t.Fatalf("Prepare after the race = %q, %v; want a VMID other than %s", next, err, id)
	}
	s.ProviderID = next
	if _, err := d.Create(ctx, s); err != nil {
		t.Fatal(err)
	}
	raced, _ := strconv.Atoi(id)
	var other bool
	for _, v := range e.fake.VMs() {
		if v.VMID == raced && v.Conf["name"] == "other-tool" {
			other = true
		}
	}
	if !other {
		t.Error("the other tool's VM is gone")
	}
	e.wantOneVM(s.ProxyID)
}

func TestErrorsInTaskExitStatusAreClassified(t *testing.T) {
	e := newEnv(t, pvetest.Options{})
	d := e.driver()
	ctx := ctxT(t, 30*time.Second)
	s := prepared(ctx, t, d, spec("web-taskfail00"))
	id := s.ProviderID
	e.fake.FailNextTask("POST", "/nodes/{node}/qemu/{vmid}/status/start", "can't lock file '/var/lock/qemu-server/lock-"+id+".conf' - got timeout")
	_, err := d.Create(ctx, s)
	var te *pve.TaskError
	if !errors.As(err, &te) || agent.Classify(err) != agent.ClassTransient {
		t.Fatalf("Create with a start task that timed out on its lock: %v, want a transient task error", err)
	}
	// The retry finishes the job without a second clone.
	if _, err := d.Create(ctx, s); err != nil {
		t.Fatal(err)
	}
	if e.fake.Clones() != 1 {
		t.Errorf("clones = %d, want 1", e.fake.Clones())
	}
	e.fake.FailNext("POST", "/nodes/{node}/qemu/{vmid}/status/stop", 403, "Permission check failed (/vms/"+id+", VM.PowerMgmt)")
	err = d.Delete(ctx, agent.Ref{ProxyID: s.ProxyID, Name: s.Name, ProviderID: id})
	if agent.Classify(err) != agent.ClassPermanent || !strings.Contains(err.Error(), "Permission check failed") {
		t.Fatalf("Delete with a 403: %v, want permanent with the message", err)
	}
}

func TestUnknownImageAndProfileArePermanent(t *testing.T) {
	e := newEnv(t, pvetest.Options{})
	d := e.driver()
	ctx := ctxT(t, 30*time.Second)
	s := spec("web-badimage00")
	s.Image = "centos"
	if _, err := d.Create(ctx, s); agent.Classify(err) != agent.ClassPermanent || !strings.Contains(err.Error(), "debian-13") {
		t.Errorf("unknown image: %v", err)
	}
	s = spec("web-badprofile")
	s.Profile = "huge"
	if _, err := d.Create(ctx, s); agent.Classify(err) != agent.ClassPermanent || !strings.Contains(err.Error(), "small") {
		t.Errorf("unknown profile: %v", err)
	}
	if e.fake.Clones() != 0 {
		t.Errorf("clones = %d, want 0", e.fake.Clones())
	}
}

func TestCheck(t *testing.T) {
	e := newEnv(t, pvetest.Options{})
	d := e.driver()
	ctx := ctxT(t, 30*time.Second)
	byName := func() map[string]agent.Verdict {
		m := map[string]agent.Verdict{}
		for _, v := range d.Check(ctx) {
			m[v.Check] = v
		}
		return m
	}
	v := byName()
	for _, name := range []string{"api", "node pve1", "template debian-13", "storage proxy-seeds"} {
		if !v[name].OK {
			t.Errorf("check %s = %+v, want ok", name, v[name])
		}
	}
	e.fake.SetNodeOnline(node, false)
	v = byName()
	if v["node pve1"].OK || v["storage proxy-seeds"].OK {
		t.Errorf("offline node: %+v / %+v, want both failing", v["node pve1"], v["storage proxy-seeds"])
	}
}

func TestImmediateLockTimeoutOnCloneIsRetried(t *testing.T) {
	e := newEnv(t, pvetest.Options{})
	d := e.driver()
	ctx := ctxT(t, 30*time.Second)
	s := prepared(ctx, t, d, spec("web-locktimeou"))
	id := s.ProviderID
	e.fake.FailNext("POST", "/nodes/{node}/qemu/{vmid}/clone", 500, "can't lock file '/var/lock/qemu-server/lock-9000.conf' - got timeout")
	var ae *pve.APIError
	if _, err := d.Create(ctx, s); !errors.As(err, &ae) || agent.Classify(err) != agent.ClassTransient {
		t.Fatalf("Create with a lock timeout: %v, want a transient API error", err)
	}
	if _, err := d.Create(ctx, s); err != nil {
		t.Fatal(err)
	}
	waitRunning(t, ctx, d, agent.Ref{ProxyID: s.ProxyID, Name: s.Name, ProviderID: id})
	if e.fake.Clones() != 1 || len(e.vmsOf(s.ProxyID)) != 1 {
		t.Errorf("clones = %d, VMs of the proxy = %d; want 1 and 1", e.fake.Clones(), len(e.vmsOf(s.ProxyID)))
	}
}

func TestDeleteDuringCloneWaitsThenDestroys(t *testing.T) {
	e := newEnv(t, pvetest.Options{TaskTicks: 30})
	ctx := ctxT(t, 30*time.Second)
	s := spec("web-delclone00")
	first := e.driver()
	id, err := first.Prepare(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	s.ProviderID = id
	crashCtx, crash := context.WithCancel(ctx)
	go func() {
		for e.fake.Clones() == 0 && crashCtx.Err() == nil {
			time.Sleep(time.Millisecond)
		}
		crash()
	}()
	_, _ = first.Create(crashCtx, s)
	crash()
	if vms := e.fake.VMs(); len(vms) != 1 || vms[0].Conf["lock"] != "clone" {
		t.Fatalf("VMs = %+v, want one being cloned", vms)
	}
	if err := e.driver().Delete(ctx, agent.Ref{ProxyID: s.ProxyID, Name: s.Name, ProviderID: id}); err != nil {
		t.Fatal(err)
	}
	if vms := e.fake.VMs(); len(vms) != 0 {
		t.Errorf("VMs after delete = %+v", vms)
	}
	if keys := e.reservations(); len(keys) != 0 {
		t.Errorf("reservations after delete = %v", keys)
	}
}
