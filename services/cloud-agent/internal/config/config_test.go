package config

import (
	"errors"
	"maps"
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
    labels: {provider: gce, region: eu-west}
    targetLabels:
      europe-west1-c: {region: eu-west-c, zone: c}
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
	if got, want := g.LabelsOf("europe-west1-b"), map[string]string{"provider": "gce", "region": "eu-west"}; !maps.Equal(got, want) {
		t.Errorf("labels of europe-west1-b = %v, want %v", got, want)
	}
	if got, want := g.LabelsOf("europe-west1-c"), map[string]string{"provider": "gce", "region": "eu-west-c", "zone": "c"}; !maps.Equal(got, want) {
		t.Errorf("labels of europe-west1-c = %v, want %v (the target's over the entry's)", got, want)
	}
	if got := f.Entries[1].LabelsOf("proxies"); got != nil {
		t.Errorf("labels of an entry without any = %v, want none", got)
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
		{"bad labels", "entries:\n  - name: a\n    type: kubernetes\n    targets: [z]\n    labels: {Region: eu, country: DE}\n    targetLabels: {y: {region: eu}, z: {zone: 'a b'}}\n",
			[]string{`entries[0].labels: every key must be`, `got "Region"`, `entries[0].labels.country: must be`, `entries[0].targetLabels.y: names no listed target`, `entries[0].targetLabels.z.zone: must be`}},
		{"too many labels with the target's", "entries:\n  - name: a\n    type: kubernetes\n    targets: [z]\n    labels: {a: '1', b: '1', c: '1', d: '1', e: '1', f: '1', g: '1', h: '1', i: '1'}\n    targetLabels: {z: {j: '1', k: '1', l: '1', m: '1', n: '1', o: '1', p: '1', q: '1'}}\n",
			[]string{`entries[0].targetLabels.z: target z would carry 17 labels`}},
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
