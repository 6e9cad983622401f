package bus_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/bus/embedded"
	"proxyfleet/pkg/testwait"
)

// An embedded server asked for port 0 names the port the kernel chose in its
// ports file (scripts/run.sh reads it to reach the planner's server), and
// removes the file when it stops.
func TestEmbedWritesPortsFile(t *testing.T) {
	ctx := testwait.Context(t, 20*time.Second)
	dir := t.TempDir()
	c, err := bus.Connect(ctx, bus.Config{
		DataDir: filepath.Join(dir, "jetstream"), Listen: "127.0.0.1:0", PortsFileDir: dir, Name: t.Name(),
		Embed: embedded.Start,
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, fmt.Sprintf("%s_%d.ports", filepath.Base(os.Args[0]), os.Getpid()))
	var ports struct {
		Nats []string `json:"nats"`
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile(path)
		if err == nil && json.Unmarshal(b, &ports) == nil && len(ports.Nats) > 0 {
			break
		}
		if time.Now().After(deadline) {
			c.Close()
			t.Fatalf("ports file %s: %v %q", path, err, b)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if want := c.ClientURL(); len(ports.Nats) != 1 || ports.Nats[0] != want {
		t.Errorf("ports file nats = %q, want [%q]", ports.Nats, want)
	}
	c.Close()
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("ports file after Close: %v, want it removed", err)
	}
}
