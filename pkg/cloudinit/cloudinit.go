// Package cloudinit builds NoCloud seeds for cloud-init: the ISO9660 image
// labelled "cidata" that carries meta-data, user-data and vendor-data, the
// vendor-data MIME multipart that installs the QEMU guest agent, and a
// default cloud-config that turns a stock Debian cloud image into a Squid
// forward proxy. Backends that boot cloud images (kvm, proxmox) share it.
//
// User-data is a secret: nothing here logs it, and it reaches the seed byte
// for byte, whatever its format (cloud-config, script, jinja template, MIME
// archive). The guest-agent bootstrap therefore never touches it; it travels
// as vendor-data, which cloud-init runs through its own handlers instead of
// merging it into the user's document.
package cloudinit

import (
	"bytes"
	"fmt"
	"mime/multipart"
	"net/textproto"
	"os"

	"github.com/kdomanski/iso9660"
)

// VolumeID is the ISO9660 volume identifier cloud-init's NoCloud source
// looks for.
const VolumeID = "cidata"

// Seed file names inside the ISO.
const (
	FileMetaData   = "meta-data"
	FileUserData   = "user-data"
	FileVendorData = "vendor-data"
)

// Seed is the content of one NoCloud seed.
type Seed struct {
	// InstanceID changes when cloud-init must treat the boot as a new
	// instance; use the instance name.
	InstanceID string
	Hostname   string
	// UserData goes into the seed unchanged. Secret: never log it.
	UserData []byte
	// VendorData is the operator's extra vendor-data; it travels beside the
	// guest-agent script as text/plain, so cloud-init sniffs its type.
	VendorData []byte
	// InstallGuestAgent adds the shell script that installs and starts
	// qemu-guest-agent.
	InstallGuestAgent bool
}

// BuildISO returns the seed as an ISO9660 image with volume id "cidata"
// holding meta-data, user-data and vendor-data.
func BuildISO(s Seed) ([]byte, error) {
	if s.InstanceID == "" {
		return nil, fmt.Errorf("cloudinit: instance id is required")
	}
	vendor, err := VendorData(s.InstallGuestAgent, s.VendorData)
	if err != nil {
		return nil, err
	}
	w, err := iso9660.NewWriter()
	if err != nil {
		return nil, fmt.Errorf("cloudinit: iso writer (needs a writable temporary directory, TMPDIR=%q): %w", os.TempDir(), err)
	}
	defer func() { _ = w.Cleanup() }()
	files := []struct {
		name string
		data []byte
	}{
		{FileMetaData, MetaData(s.InstanceID, s.Hostname)},
		{FileUserData, s.UserData},
		{FileVendorData, vendor},
	}
	for _, f := range files {
		if err := w.AddFile(bytes.NewReader(f.data), f.name); err != nil {
			return nil, fmt.Errorf("cloudinit: stage %s: %w", f.name, err)
		}
	}
	var buf bytes.Buffer
	if err := w.WriteTo(&buf, VolumeID); err != nil {
		return nil, fmt.Errorf("cloudinit: write iso: %w", err)
	}
	img := buf.Bytes()
	if err := clearVolumeDates(img); err != nil {
		return nil, err
	}
	return img, nil
}

// The primary volume descriptor sits in sector 16; its creation,
// modification, expiration and effective dates are four 17-byte fields
// from byte 813 (ECMA-119 8.4.26-8.4.29).
const (
	pvdOffset    = 16 * 2048
	pvdDatesFrom = 813
	pvdDatesTo   = 813 + 4*17
)

// unspecifiedDate is ECMA-119's "date and time not specified": sixteen
// '0' digits and a zero time-zone offset.
var unspecifiedDate = append(bytes.Repeat([]byte{'0'}, 16), 0)

// clearVolumeDates sets the volume descriptor's dates to "not specified".
// The writer stamps them with the current time, the only part of the
// image that is not a function of the seed, so without this the same
// seed gave different bytes on every render and no backend could prove it
// uploads the seed that booted. File records already carry no date.
func clearVolumeDates(img []byte) error {
	if len(img) < pvdOffset+pvdDatesTo || img[pvdOffset] != 1 || string(img[pvdOffset+1:pvdOffset+6]) != "CD001" {
		return fmt.Errorf("cloudinit: write iso: no primary volume descriptor in sector 16")
	}
	for off := pvdOffset + pvdDatesFrom; off < pvdOffset+pvdDatesTo; off += len(unspecifiedDate) {
		copy(img[off:], unspecifiedDate)
	}
	return nil
}

// MetaData returns the NoCloud meta-data document. Both values are quoted,
// so any string is safe.
func MetaData(instanceID, hostname string) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "instance-id: %s\n", yamlString(instanceID))
	if hostname != "" {
		fmt.Fprintf(&b, "local-hostname: %s\n", yamlString(hostname))
	}
	return b.Bytes()
}

// guestAgentScript installs and starts qemu-guest-agent with whichever
// package manager the image has. cloud-init runs vendor-data scripts from
// its scripts-vendor stage, after the user's packages and before runcmd
// finishes, and never merges them into user-data.
const guestAgentScript = `#!/bin/sh
# Installed by proxyfleet: the agent learns the guest's address from qemu-guest-agent.
if ! command -v qemu-ga >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q || true
    apt-get install -y -q qemu-guest-agent
  elif command -v dnf >/dev/null 2>&1; then
    dnf install -y qemu-guest-agent
  elif command -v yum >/dev/null 2>&1; then
    yum install -y qemu-guest-agent
  elif command -v apk >/dev/null 2>&1; then
    apk add qemu-guest-agent
  fi
fi
if command -v systemctl >/dev/null 2>&1; then
  systemctl enable --now qemu-guest-agent || systemctl start qemu-guest-agent || true
fi
# A mark on the console (the serial log shows the script ran); harmless without one.
{ echo "proxyfleet: guest-agent bootstrap done" >/dev/console; } 2>/dev/null || true
`

// mimeBoundary is fixed so the same inputs give the same bytes.
const mimeBoundary = "proxyfleet-vendor-data-boundary"

// VendorData returns the vendor-data document: a MIME multipart holding the
// guest-agent shell script (when installGuestAgent) and the operator's
// vendor-data as text/plain (when not empty), so cloud-init detects its
// type itself. With neither it returns an empty document.
func VendorData(installGuestAgent bool, userVendorData []byte) ([]byte, error) {
	if !installGuestAgent && len(userVendorData) == 0 {
		return []byte{}, nil
	}
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	if err := mw.SetBoundary(mimeBoundary); err != nil {
		return nil, err
	}
	if bytes.Contains(userVendorData, []byte(mimeBoundary)) {
		return nil, fmt.Errorf("cloudinit: vendor-data contains the MIME boundary %q", mimeBoundary)
	}
	part := func(ctype, filename string, data []byte) error {
		h := textproto.MIMEHeader{}
		h.Set("Content-Type", ctype+`; charset="us-ascii"`)
		h.Set("MIME-Version", "1.0")
		h.Set("Content-Transfer-Encoding", "7bit")
		h.Set("Content-Disposition", `attachment; filename="`+filename+`"`)
		pw, err := mw.CreatePart(h)
		if err != nil {
			return err
		}
		_, err = pw.Write(data)
		return err
	}
	if installGuestAgent {
		if err := part("text/x-shellscript", "proxyfleet-guest-agent.sh", []byte(guestAgentScript)); err != nil {
			return nil, err
		}
	}
	if len(userVendorData) > 0 {
		if err := part("text/plain", "vendor-data", userVendorData); err != nil {
			return nil, err
		}
	}
	if err := mw.Close(); err != nil {
		return nil, err
	}
	var out bytes.Buffer
	fmt.Fprintf(&out, "Content-Type: multipart/mixed; boundary=\"%s\"\nMIME-Version: 1.0\n\n", mimeBoundary)
	out.Write(body.Bytes())
	return out.Bytes(), nil
}
