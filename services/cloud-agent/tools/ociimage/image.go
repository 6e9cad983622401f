package main

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"
)

type options struct {
	layer, name, out, user, arch string
	entrypoint, cmd              []string
}

// The OCI media types and annotations the image layout uses.
const (
	mediaIndex    = "application/vnd.oci.image.index.v1+json"
	mediaManifest = "application/vnd.oci.image.manifest.v1+json"
	mediaConfig   = "application/vnd.oci.image.config.v1+json"
	mediaLayer    = "application/vnd.oci.image.layer.v1.tar"
	// annotationRefName is the tag an OCI layout names a manifest by;
	// annotationImageName is the full reference containerd imports it as.
	annotationRefName   = "org.opencontainers.image.ref.name"
	annotationImageName = "io.containerd.image.name"
)

// defaultPath is the PATH a Debian image's processes get.
const defaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Platform    *platform         `json:"platform,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

type platform struct {
	Architecture string `json:"architecture"`
	OS           string `json:"os"`
}

type imageConfig struct {
	Created      time.Time `json:"created"`
	Architecture string    `json:"architecture"`
	OS           string    `json:"os"`
	Config       struct {
		User       string   `json:"User,omitempty"`
		Env        []string `json:"Env"`
		Entrypoint []string `json:"Entrypoint,omitempty"`
		Cmd        []string `json:"Cmd,omitempty"`
		WorkingDir string   `json:"WorkingDir"`
	} `json:"config"`
	RootFS struct {
		Type    string   `json:"type"`
		DiffIDs []string `json:"diff_ids"`
	} `json:"rootfs"`
}

type manifest struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Config        descriptor   `json:"config"`
	Layers        []descriptor `json:"layers"`
}

type index struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Manifests     []descriptor `json:"manifests"`
}

// tag returns the tag of ref ("latest" when it has none).
func tag(ref string) string {
	if i := strings.LastIndex(ref, ":"); i > strings.LastIndex(ref, "/") {
		return ref[i+1:]
	}
	return "latest"
}

// write writes the image layout of o as a tar to o.out.
func write(o options) error {
	layerDigest, layerSize, err := digestFile(o.layer)
	if err != nil {
		return err
	}
	var cfg imageConfig
	cfg.Created = time.Unix(0, 0).UTC() // the image is a function of its layer and options
	cfg.Architecture, cfg.OS = o.arch, "linux"
	cfg.Config.User, cfg.Config.Env = o.user, []string{defaultPath}
	cfg.Config.Entrypoint, cfg.Config.Cmd, cfg.Config.WorkingDir = o.entrypoint, o.cmd, "/"
	cfg.RootFS.Type, cfg.RootFS.DiffIDs = "layers", []string{layerDigest}
	cfgJSON, err := json.Marshal(cfg)
	if err != nil {
		return err
	}
	m := manifest{SchemaVersion: 2, MediaType: mediaManifest,
		Config: descriptor{MediaType: mediaConfig, Digest: digest(cfgJSON), Size: int64(len(cfgJSON))},
		Layers: []descriptor{{MediaType: mediaLayer, Digest: layerDigest, Size: layerSize}}}
	mJSON, err := json.Marshal(m)
	if err != nil {
		return err
	}
	idx := index{SchemaVersion: 2, MediaType: mediaIndex, Manifests: []descriptor{{
		MediaType: mediaManifest, Digest: digest(mJSON), Size: int64(len(mJSON)),
		Platform:    &platform{Architecture: o.arch, OS: "linux"},
		Annotations: map[string]string{annotationRefName: tag(o.name), annotationImageName: o.name},
	}}}
	idxJSON, err := json.Marshal(idx)
	if err != nil {
		return err
	}

	tmp, err := os.CreateTemp(filepath.Dir(o.out), ".ociimage-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	tw := tar.NewWriter(tmp)
	files := []struct {
		name string
		data []byte
	}{
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", idxJSON},
		{blobPath(m.Config.Digest), cfgJSON},
		{blobPath(idx.Manifests[0].Digest), mJSON},
	}
	for _, dir := range []string{"blobs/", "blobs/sha256/"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dir, Mode: 0o755, ModTime: cfg.Created}); err != nil {
			return err
		}
	}
	for _, f := range files {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: f.name, Mode: 0o644, Size: int64(len(f.data)), ModTime: cfg.Created}); err != nil {
			return err
		}
		if _, err := tw.Write(f.data); err != nil {
			return err
		}
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: blobPath(layerDigest), Mode: 0o644, Size: layerSize, ModTime: cfg.Created}); err != nil {
		return err
	}
	lf, err := os.Open(o.layer)
	if err != nil {
		return err
	}
	defer lf.Close()
	if n, err := io.Copy(tw, lf); err != nil {
		return err
	} else if n != layerSize {
		return fmt.Errorf("%s changed while it was written (%d bytes, then %d)", o.layer, layerSize, n)
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), o.out)
}

func blobPath(d string) string { return "blobs/sha256/" + strings.TrimPrefix(d, "sha256:") }

func digest(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

func digestFile(path string) (string, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, err
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), n, nil
}
