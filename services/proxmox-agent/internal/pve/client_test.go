package pve_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/proxmox-agent/internal/pve"
	"proxyfleet/services/proxmox-agent/internal/pve/pvetest"
)

// newClient returns a client of fake that pins its certificate.
func newClient(t *testing.T, fake *pvetest.Server) *pve.Client {
	t.Helper()
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(fake.Token()+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := pve.New(pve.Config{URL: fake.URL, TokenFile: tokenFile,
		Fingerprint: pve.FormatFingerprint(fake.Fingerprint()), TaskPollInterval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestWrongFingerprintRefusesToConnect(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{})
	tokenFile := filepath.Join(t.TempDir(), "token")
	_ = os.WriteFile(tokenFile, []byte(fake.Token()), 0o600)
	wrong := sha256.Sum256([]byte("some other certificate"))
	c, err := pve.New(pve.Config{URL: fake.URL, TokenFile: tokenFile, Fingerprint: pve.FormatFingerprint(wrong[:])})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Version(ctxT(t))
	if !errors.Is(err, pve.ErrFingerprintMismatch) {
		t.Fatalf("Version with a wrong pin: got %v, want ErrFingerprintMismatch", err)
	}
	if !strings.Contains(err.Error(), "pinned") || !strings.Contains(err.Error(), pve.FormatFingerprint(wrong[:])) {
		t.Errorf("error %q does not say which pin failed", err)
	}
	if got := agent.Classify(err); got != agent.ClassPermanent {
		t.Errorf("class = %s, want permanent", got)
	}
	if len(fake.Calls()) != 0 {
		t.Errorf("the fake received %d requests; a refused connection must send none", len(fake.Calls()))
	}
}

func TestNoPinAndNoCAVerifiesAgainstSystemRoots(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{})
	tokenFile := filepath.Join(t.TempDir(), "token")
	_ = os.WriteFile(tokenFile, []byte(fake.Token()), 0o600)
	c, err := pve.New(pve.Config{URL: fake.URL, TokenFile: tokenFile})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Version(ctxT(t)); err == nil {
		t.Fatal("a self-signed server was accepted without a CA or a pin")
	}
}

func TestCAFileVerifies(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{})
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	_ = os.WriteFile(tokenFile, []byte(fake.Token()), 0o600)
	ca := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(ca, pemCert(fake), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := pve.New(pve.Config{URL: fake.URL, TokenFile: tokenFile, CAFile: ca})
	if err != nil {
		t.Fatal(err)
	}
	v, err := c.Version(ctxT(t))
	if err != nil || v.Release == "" {
		t.Fatalf("Version = %+v, %v", v, err)
	}
}

func TestWrongTokenIsPermanent(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{Token: "fleet@pve!agent=right"})
	tokenFile := filepath.Join(t.TempDir(), "token")
	_ = os.WriteFile(tokenFile, []byte("fleet@pve!agent=wrong"), 0o600)
	c, err := pve.New(pve.Config{URL: fake.URL, TokenFile: tokenFile, Fingerprint: pve.FormatFingerprint(fake.Fingerprint())})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Version(ctxT(t))
	var ae *pve.APIError
	if !errors.As(err, &ae) || ae.Status != 401 || !errors.Is(err, agent.ErrPermanent) {
		t.Fatalf("got %v, want a permanent 401", err)
	}
}

func TestParseToken(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want string
		ok   bool
	}{
		{"fleet@pve!agent=0f2c-11\n", "fleet@pve!agent=0f2c-11", true},
		{"PVEAPIToken=fleet@pve!agent=abc", "fleet@pve!agent=abc", true},
		{"fleet@pve=abc", "", false},
		{"fleet!agent=abc", "", false},
		{"fleet@pve!agent=", "", false},
		{"fleet@pve!agent=a b", "", false},
	} {
		got, err := pve.ParseToken(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("ParseToken(%q) = %q, %v; want %q, ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestImmediateErrorCarriesReasonAndMessage(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{})
	fake.AddTemplate("pve1", 9000, "debian-13")
	c := newClient(t, fake)
	ctx := ctxT(t)
	// Starting a template is refused at once.
	_, err := c.Start(ctx, "pve1", 9000)
	var ae *pve.APIError
	if !errors.As(err, &ae) {
		t.Fatalf("got %v, want *APIError", err)
	}
	if ae.Status != 500 || ae.Reason != "you can't start a vm if it's a template" || ae.Message != ae.Reason {
		t.Errorf("got status %d reason %q message %q", ae.Status, ae.Reason, ae.Message)
	}
	if !errors.Is(err, agent.ErrPermanent) {
		t.Errorf("starting a template: class %s, want permanent", agent.Classify(err))
	}
	// The connection was closed after the error; the next call still works.
	if _, err := c.Version(ctx); err != nil {
		t.Fatalf("Version after an error: %v", err)
	}
}

func TestParameterErrorIsPermanentAndNamesTheParameter(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{})
	fake.AddTemplate("pve1", 9000, "debian-13")
	c := newClient(t, fake)
	_, err := c.Clone(ctxT(t), "pve1", 9000, 101, pve.CloneOptions{Name: "not_a_dns_name"})
	var ae *pve.APIError
	if !errors.As(err, &ae) || ae.Status != 400 || ae.Errors["name"] == "" {
		t.Fatalf("got %v, want a 400 naming parameter name", err)
	}
	if !errors.Is(err, agent.ErrPermanent) || !strings.Contains(err.Error(), "name:") {
		t.Errorf("got %v (class %s), want permanent and naming the parameter", err, agent.Classify(err))
	}
}

func TestUnknownURIIs501(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{})
	c := newClient(t, fake)
	// A task status of a node that exists but a path the fake does not serve.
	_, err := c.TaskLog(ctxT(t), "pve1", "UPID:pve1:1:2:3:qmstart:100:root@pam:", 10)
	var ae *pve.APIError
	if !errors.As(err, &ae) || ae.Status != 500 {
		t.Fatalf("log of an unknown task: got %v, want 500 no such task", err)
	}
	req, _ := http.NewRequest(http.MethodGet, fake.URL+"/api2/json/nodes/pve1/bogus", nil)
	resp, err := fake.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 501 || resp.Status != "501 no such uri" || !resp.Close {
		t.Errorf("unknown path: status %q close=%v, want \"501 no such uri\" and a closed connection", resp.Status, resp.Close)
	}
}

func TestCloneTaskRunsForSeveralPollsThenCompletes(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{TaskTicks: 5})
	fake.AddTemplate("pve1", 9000, "debian-13")
	c := newClient(t, fake)
	ctx := ctxT(t)
	upid, err := c.Clone(ctx, "pve1", 9000, 100, pve.CloneOptions{Name: "px-a", Description: "d"})
	if err != nil {
		t.Fatal(err)
	}
	st, err := c.TaskStatus(ctx, "pve1", upid)
	if err != nil || st.Status != "running" {
		t.Fatalf("first poll: %+v %v, want running", st, err)
	}
	res, _ := c.Resources(ctx, "vm")
	var seen bool
	for _, r := range res {
		if r.VMID == 100 {
			seen = true
			if r.Name != "" || r.Lock != "clone" {
				t.Errorf("cloning VM in resources: %+v, want no name and lock clone", r)
			}
		}
	}
	if !seen {
		t.Fatal("the VM being cloned is missing from /cluster/resources")
	}
	if err := c.WaitTask(ctx, upid); err != nil {
		t.Fatalf("WaitTask: %v", err)
	}
	cfg, err := c.Config(ctx, "pve1", 100)
	if err != nil || cfg.Name != "px-a" || cfg.Lock != "" || cfg.Description != "d" {
		t.Fatalf("config after clone: %+v %v", cfg, err)
	}
}

func TestTaskExitStatusErrorCarriesLogAndClass(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{})
	fake.AddTemplate("pve1", 9000, "debian-13")
	c := newClient(t, fake)
	ctx := ctxT(t)
	fake.FailNextTask("POST", "/nodes/{node}/qemu/{vmid}/clone", "can't lock file '/var/lock/qemu-server/lock-9000.conf' - got timeout")
	upid, err := c.Clone(ctx, "pve1", 9000, 100, pve.CloneOptions{Name: "px-a"})
	if err != nil {
		t.Fatalf("the request itself must succeed: %v", err)
	}
	err = c.WaitTask(ctx, upid)
	var te *pve.TaskError
	if !errors.As(err, &te) || !strings.Contains(te.ExitStatus, "got timeout") || len(te.Log) == 0 {
		t.Fatalf("got %v, want a TaskError with the exit status and log", err)
	}
	if !errors.Is(err, agent.ErrTransient) {
		t.Errorf("lock timeout in a task: class %s, want transient", agent.Classify(err))
	}
	if vms := fake.VMs(); len(vms) != 0 {
		t.Errorf("a failed clone left %d VMs", len(vms))
	}
}

func TestNextIDAsStringOrNumber(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{NextIDAsString: true})
	c := newClient(t, fake)
	for i := 0; i < 2; i++ {
		id, err := c.NextID(ctxT(t))
		if err != nil || id != 100 {
			t.Fatalf("NextID #%d = %d, %v; want 100 (nextid reserves nothing)", i, id, err)
		}
	}
}

func TestUPIDNode(t *testing.T) {
	n, err := pve.UPIDNode("UPID:pve2:000ABC:0012:65:qmclone:9000:root@pam!fleet:")
	if err != nil || n != "pve2" {
		t.Errorf("UPIDNode = %q, %v", n, err)
	}
	if _, err := pve.UPIDNode("garbage"); err == nil {
		t.Error("UPIDNode(garbage) succeeded")
	}
}

func TestSharedLockOnAStoppedCloneSource(t *testing.T) {
	fake := pvetest.Start(t, pvetest.Options{TaskTicks: 50})
	fake.AddTemplate("pve1", 9000, "debian-13")
	c := newClient(t, fake)
	ctx := ctxT(t)
	u1, err := c.Clone(ctx, "pve1", 9000, 100, pve.CloneOptions{Name: "px-a"})
	if err != nil {
		t.Fatal(err)
	}
	// A second clone of the same stopped template runs beside the first.
	u2, err := c.Clone(ctx, "pve1", 9000, 101, pve.CloneOptions{Name: "px-b"})
	if err != nil {
		t.Fatalf("second clone of a stopped template: %v", err)
	}
	for _, tc := range []struct {
		name string
		call func() error
		want string
	}{
		{"change the template", func() error {
			return c.SetConfig(ctx, "pve1", 9000, map[string][]string{"cores": {"2"}})
		}, "can't lock file '/var/lock/qemu-server/lock-9000.conf' - got timeout"},
		{"change the clone", func() error {
			return c.SetConfig(ctx, "pve1", 100, map[string][]string{"cores": {"2"}})
		}, "VM is locked (clone)"},
		{"start the clone", func() error { _, err := c.Start(ctx, "pve1", 100); return err }, "VM is locked (clone)"},
		{"destroy the clone", func() error { _, err := c.DeleteVM(ctx, "pve1", 101); return err }, "VM is locked (clone)"},
	} {
		err := tc.call()
		var ae *pve.APIError
		if !errors.As(err, &ae) || ae.Message != tc.want || !errors.Is(err, agent.ErrTransient) {
			t.Errorf("%s during the clones: %v, want transient %q", tc.name, err, tc.want)
		}
	}
	if err := c.WaitTask(ctx, u1); err != nil {
		t.Fatal(err)
	}
	if err := c.WaitTask(ctx, u2); err != nil {
		t.Fatal(err)
	}
	if err := c.SetConfig(ctx, "pve1", 9000, map[string][]string{"cores": {"2"}}); err != nil {
		t.Errorf("changing the template after the clones: %v", err)
	}
	if _, err := c.DeleteVM(ctx, "pve1", 9000); err == nil || !strings.Contains(err.Error(), "linked clone") {
		t.Errorf("destroying a template with linked clones: %v, want refused", err)
	}
}
