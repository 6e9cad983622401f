// Package seedtest gives tests of every backend the seed the kvm
// cloud-image end-to-end test boots (the "operator seed": an operator's
// cloud-config with its own packages and runcmd, and the guest-agent
// vendor-data), so each backend can assert that what it uploads is that
// seed byte for byte, and a reader of NoCloud ISO images.
package seedtest

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kdomanski/iso9660"

	"proxyfleet/pkg/cloudinit"
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/internal/srcroot"
)

// OperatorProxyID is the proxy the kvm end-to-end test boots the operator
// seed for; OperatorInstance, its instance name, is the seed's instance id
// and hostname.
const OperatorProxyID = "operator-seed"

// OperatorInstance is the instance name of OperatorProxyID.
var OperatorInstance = events.InstanceName(OperatorProxyID)

// testdata is pkg/cloudinit/testdata, found in the source tree so tests
// of any module can read it.
func testdata() string {
	return srcroot.Join("pkg", "cloudinit", "testdata")
}

// OperatorUserData returns the operator seed's user-data: the bytes of
// pkg/cloudinit/testdata/operator-cloud-config.yaml.
func OperatorUserData(t testing.TB) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(testdata(), "operator-cloud-config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// OperatorSeed returns the operator seed's inputs and its ISO image,
// after checking the image against the golden sha256 in
// pkg/cloudinit/testdata/operator-seed.sha256 (the seed that booted).
func OperatorSeed(t testing.TB) (cloudinit.Seed, []byte) {
	t.Helper()
	s := cloudinit.Seed{InstanceID: OperatorInstance, Hostname: OperatorInstance, UserData: OperatorUserData(t), InstallGuestAgent: true}
	iso, err := cloudinit.BuildISO(s)
	if err != nil {
		t.Fatal(err)
	}
	want, err := os.ReadFile(filepath.Join(testdata(), "operator-seed.sha256"))
	if err != nil {
		t.Fatal(err)
	}
	if got := SHA256(iso); got != strings.TrimSpace(string(want)) {
		t.Fatalf("the operator seed renders to sha256 %s, the golden file says %s (pkg/cloudinit's TestOperatorSeedGolden tells why)", got, strings.TrimSpace(string(want)))
	}
	return s, iso
}

// SHA256 is the hex sha256 of b.
func SHA256(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// Files returns the volume label and the files of the root directory of
// an ISO9660 image.
func Files(img []byte) (string, map[string][]byte, error) {
	im, err := iso9660.OpenImage(bytes.NewReader(img))
	if err != nil {
		return "", nil, fmt.Errorf("open iso: %w", err)
	}
	label, err := im.Label()
	if err != nil {
		return "", nil, fmt.Errorf("iso label: %w", err)
	}
	root, err := im.RootDir()
	if err != nil {
		return "", nil, fmt.Errorf("iso root: %w", err)
	}
	children, err := root.GetChildren()
	if err != nil {
		return "", nil, fmt.Errorf("iso root directory: %w", err)
	}
	files := map[string][]byte{}
	for _, c := range children {
		if c.IsDir() {
			continue
		}
		b, err := io.ReadAll(c.Reader())
		if err != nil {
			return "", nil, fmt.Errorf("read %s: %w", c.Name(), err)
		}
		files[c.Name()] = b
	}
	return label, files, nil
}
