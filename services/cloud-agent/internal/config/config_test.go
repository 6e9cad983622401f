package config

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"proxyfleet/pkg/agentconfig"
)

const good = `
entries:
  - name: gce-eu
    type: gce
    targets: [europe-west1-b, europe-west1-c]
    capacity: 10
    commandTimeout: 15m
    gce:
      project: my-project
      credentialsFile: /etc/proxyfleet/gce.json
      images: {debian-12: projects/debian-cloud/global/images/family/debian-12}
      defaultImage: debian-12
      profiles: {small: e2-small}
      defaultProfile: small
      network: global/networks/default
      tags: [proxyfleet-proxy]
      externalIP: true
  - name: k8s-home
    type: kubernetes
    targets: [proxies]
    kubernetes:
      images: {squid: ubuntu/squid:6.10}
      profiles: {small: {cpu: 100m, memory: 128Mi}}
`

func TestParseGood(t *testing.T) {
	f, err := Parse([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if len(f.Entries) != 2 {
		t.Fatalf("entries = %d, want 2", len(f.Entries))
	}
	g := f.Entries[0]
	if g.GCE.Project != "my-project" || g.Capacity != 10 || len(g.Targets) != 2 {
		t.Fatalf("gce entry = %+v", g)
	}
	k := f.Entries[1].Kubernetes
	if k.Image != DefaultSquidImage || k.AuthHelper != DefaultAuthHelper || k.RunAsUser != DefaultSquidUser || k.ClusterScope {
		t.Fatalf("kubernetes defaults not applied: %+v", k)
	}
}

func TestParseKubernetesWithoutSection(t *testing.T) {
	f, err := Parse([]byte("entries:\n  - {name: k, type: kubernetes, targets: [default]}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if f.Entries[0].Kubernetes == nil || f.Entries[0].Kubernetes.Image != DefaultSquidImage {
		t.Fatalf("kubernetes section = %+v", f.Entries[0].Kubernetes)
	}
}

func TestParseErrors(t *testing.T) {
	cases := []struct {
		name, doc string
		want      []string // fields named in the error
	}{
		{"empty", ``, []string{"empty config"}},
		{"no entries", `entries: []`, []string{"entries"}},
		{"unknown key", "entries:\n  - {name: a, type: gce, targts: [z]}\n", []string{"targts"}},
		{"bad type", "entries:\n  - {name: a, type: aws, targets: [z]}\n", []string{"entries[0].type"}},
		{"bad name and target", "entries:\n  - {name: A_b, type: kubernetes, targets: [Ns, ns, ns]}\n",
			[]string{"entries[0].name", "entries[0].targets[0]", "entries[0].targets[2]"}},
		{"duplicate entry", "entries:\n  - {name: a, type: kubernetes, targets: [x]}\n  - {name: a, type: kubernetes, targets: [y]}\n",
			[]string{"entries[1].name"}},
		{"gce without section", "entries:\n  - {name: a, type: gce, targets: [z]}\n", []string{"entries[0].gce"}},
		{"gce incomplete", "entries:\n  - name: a\n    type: gce\n    targets: [z]\n    gce: {defaultImage: x, tags: [Bad_Tag]}\n",
			[]string{".gce.project", ".gce.images", ".gce.profiles", ".gce.defaultImage", ".gce.tags[0]"}},
		{"mixed sections", "entries:\n  - name: a\n    type: kubernetes\n    targets: [z]\n    gce: {project: p}\n", []string{"entries[0].gce"}},
		{"bad duration", "entries:\n  - {name: a, type: kubernetes, targets: [z], commandTimeout: soon}\n", []string{"duration"}},
		{"relative helper", "entries:\n  - name: a\n    type: kubernetes\n    targets: [z]\n    kubernetes: {authHelper: basic_ncsa_auth}\n", []string{"authHelper"}},
		{"unpinned images", "entries:\n  - name: a\n    type: kubernetes\n    targets: [z]\n    kubernetes: {image: 'ubuntu/squid:latest', images: {b: 'reg:5000/squid'}}\n",
			[]string{`.kubernetes.image: must pin a tag or digest, not :latest, got "ubuntu/squid:latest"`, `.kubernetes.images.b: must pin a tag or digest, got "reg:5000/squid"`}},
		{"root squid", "entries:\n  - name: a\n    type: kubernetes\n    targets: [z]\n    kubernetes: {runAsUser: -1}\n", []string{"runAsUser"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse([]byte(c.doc))
			if err == nil {
				t.Fatal("Parse succeeded, want an error")
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

func TestConfigErrorIsStructured(t *testing.T) {
	_, err := Parse([]byte("entries:\n  - {name: a, type: gce, targets: [z], capacity: -1}\n"))
	ce, ok := errors.AsType[*agentconfig.Error](err)
	if !ok {
		t.Fatalf("error %v is not an *agentconfig.Error", err)
	}
	want := []agentconfig.Problem{
		{Key: "entries[0].capacity", Reason: "must be 0 (unlimited) or more, got -1"},
		{Key: "entries[0].gce", Reason: "is required for type gce"},
	}
	if !slices.Equal(ce.Problems, want) {
		t.Errorf("problems:\n got %q\nwant %q", ce.Problems, want)
	}
}
