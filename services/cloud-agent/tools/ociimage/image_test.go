package main

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"testing"
)

// TestWriteLayout checks the layout ctr images import reads: every blob
// named by its sha256, the index naming the image, the manifest pointing at
// the config and the layer, and the layer's digest as its diff ID.
func TestWriteLayout(t *testing.T) {
	dir := t.TempDir()
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	body := []byte("#!/bin/sh\n")
	if err := tw.WriteHeader(&tar.Header{Name: "./bin/x", Mode: 0o755, Size: int64(len(body))}); err != nil {
		t.Fatal(err)
	}
	_, _ = tw.Write(body)
	_ = tw.Close()
	layerPath := filepath.Join(dir, "rootfs.tar")
	if err := os.WriteFile(layerPath, layer.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "image.tar")
	o := options{layer: layerPath, name: "localhost/proxyfleet/squid:abc", out: out, user: "13:13", arch: "amd64", cmd: []string{"squid", "-N"}}
	if err := write(o); err != nil {
		t.Fatal(err)
	}

	f, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	files := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(tr)
		files[h.Name] = b
	}
	blob := func(d descriptor) []byte {
		t.Helper()
		b, ok := files[blobPath(d.Digest)]
		if !ok || digest(b) != d.Digest || int64(len(b)) != d.Size {
			t.Fatalf("blob %s: present %v, digest or size differs", d.Digest, ok)
		}
		return b
	}
	if string(files["oci-layout"]) != `{"imageLayoutVersion":"1.0.0"}` {
		t.Fatalf("oci-layout = %q", files["oci-layout"])
	}
	var idx index
	if err := json.Unmarshal(files["index.json"], &idx); err != nil || len(idx.Manifests) != 1 {
		t.Fatalf("index.json: %v %+v", err, idx)
	}
	d := idx.Manifests[0]
	if d.Annotations[annotationImageName] != o.name || d.Annotations[annotationRefName] != "abc" || d.Platform.Architecture != "amd64" {
		t.Fatalf("index descriptor = %+v", d)
	}
	var m manifest
	if err := json.Unmarshal(blob(d), &m); err != nil || len(m.Layers) != 1 {
		t.Fatalf("manifest: %v %+v", err, m)
	}
	var cfg imageConfig
	if err := json.Unmarshal(blob(m.Config), &cfg); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(blob(m.Layers[0]), layer.Bytes()) || cfg.RootFS.DiffIDs[0] != m.Layers[0].Digest {
		t.Fatalf("layer differs from its input or from the diff ID %v", cfg.RootFS.DiffIDs)
	}
	if cfg.Config.User != "13:13" || cfg.Config.Env[0] != defaultPath || len(cfg.Config.Cmd) != 2 || cfg.OS != "linux" {
		t.Fatalf("config = %+v", cfg.Config)
	}
}

func TestTag(t *testing.T) {
	for ref, want := range map[string]string{"a/b:c": "c", "host:5000/b": "latest", "host:5000/b:v1": "v1", "b": "latest"} {
		if got := tag(ref); got != want {
			t.Errorf("tag(%q) = %q, want %q", ref, got, want)
		}
	}
}
