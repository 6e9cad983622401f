package pve_test

import (
	"errors"
	"fmt"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/proxmox-agent/internal/pve"
)

func TestClassify(t *testing.T) {
	api := func(status int, msg string, errs map[string]string) error {
		return &pve.APIError{Op: "POST /x", Status: status, Reason: msg, Message: msg, Errors: errs}
	}
	task := func(exit string, log ...string) error {
		return &pve.TaskError{UPID: "UPID:pve1:1:2:3:qmclone:9000:root@pam:", Type: "qmclone", ExitStatus: exit, Log: log}
	}
	for _, tc := range []struct {
		name     string
		err      error
		class    string
		vmidRace bool
	}{
		{"immediate lock timeout", api(500, "can't lock file '/var/lock/qemu-server/lock-110.conf' - got timeout", nil), agent.ClassTransient, false},
		{"task lock timeout", task("can't lock file '/var/lock/qemu-server/lock-110.conf' - got timeout"), agent.ClassTransient, false},
		{"immediate VM locked", api(500, "VM is locked (clone)", nil), agent.ClassTransient, false},
		{"task VM locked", task("VM is locked (clone)"), agent.ClassTransient, false},
		{"immediate VMID race", api(500, "unable to create VM 105: config file already exists", nil), agent.ClassTransient, true},
		{"task VMID race", task("unable to create VM 105: config file already exists"), agent.ClassTransient, true},
		{"5xx", api(500, "got unexpected control message", nil), agent.ClassTransient, false},
		{"proxy 596", api(596, "Connection timed out", nil), agent.ClassTransient, false},
		{"401", api(401, "authentication failure", nil), agent.ClassPermanent, false},
		{"403", api(403, "Permission check failed (/vms/105, VM.Allocate)", nil), agent.ClassPermanent, false},
		{"parameter error", api(400, "Parameter verification failed.", map[string]string{"newid": "value must have a minimum value of 100"}), agent.ClassPermanent, false},
		{"501 no such uri", api(501, "no such uri", nil), agent.ClassPermanent, false},
		{"start a template", api(500, "you can't start a vm if it's a template", nil), agent.ClassPermanent, false},
		{"missing storage in task", task("storage 'proxy-seeds' does not exist"), agent.ClassPermanent, false},
		{"VM gone", api(500, "Configuration file 'nodes/pve1/qemu-server/105.conf' does not exist", nil), agent.ClassNotFound, false},
		{"volume gone in task", task("volume 'proxy-seeds:iso/px-a.iso' does not exist"), agent.ClassNotFound, false},
		{"running VM destroy", api(500, "VM 113 is running - destroy failed", nil), agent.ClassTransient, false},
		{"storage full", task("not enough space on storage 'proxy-seeds'"), agent.ClassQuota, false},
		{"unknown task failure", task("something odd happened"), agent.ClassTransient, false},
		{"wrapped immediate", fmt.Errorf("clone: %w", api(500, "unable to create VM 105: config file already exists", nil)), agent.ClassTransient, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := pve.Classify(tc.err)
			if c := agent.Classify(got); c != tc.class {
				t.Errorf("class = %s, want %s (%v)", c, tc.class, got)
			}
			if race := errors.Is(got, pve.ErrVMIDTaken); race != tc.vmidRace {
				t.Errorf("errors.Is(ErrVMIDTaken) = %v, want %v", race, tc.vmidRace)
			}
			if got.Error() != tc.err.Error() {
				t.Errorf("message changed: %q, want %q", got.Error(), tc.err.Error())
			}
		})
	}
}
