package config

import (
	"bytes"
	"errors"
	"io"
	"os"
	"testing"

	"go.yaml.in/yaml/v3"
)

// TestShippedManifestConfigParses checks that the config embedded in the
// Kubernetes Deployment manifest is valid.
func TestShippedManifestConfigParses(t *testing.T) {
	b, err := os.ReadFile("../../../../deploy/kubernetes/cloud-agent.yaml")
	if err != nil {
		t.Fatal(err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	found := false
	for {
		var doc struct {
			Kind string            `yaml:"kind"`
			Data map[string]string `yaml:"data"`
		}
		if err := dec.Decode(&doc); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		if doc.Kind != "ConfigMap" {
			continue
		}
		found = true
		if _, err := Parse([]byte(doc.Data["cloud-agent.yaml"])); err != nil {
			t.Fatalf("the manifest's config is invalid: %v", err)
		}
	}
	if !found {
		t.Fatal("no ConfigMap in the manifest")
	}
}
