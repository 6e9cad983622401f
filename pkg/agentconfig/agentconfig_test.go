package agentconfig_test

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"proxyfleet/pkg/agentconfig"
	"proxyfleet/pkg/events"
)

// testConfig has the shapes agent configs have: a list of entries, maps
// keyed by image name, durations and numbers.
type testConfig struct {
	Entries []testEntry          `yaml:"entries"`
	Timeout agentconfig.Duration `yaml:"timeout"`
}

type testEntry struct {
	Name         string               `yaml:"name"`
	DefaultImage string               `yaml:"defaultImage"`
	Capacity     int                  `yaml:"capacity"`
	Images       map[string]testImage `yaml:"images"`
	Tags         []string             `yaml:"tags"`
}

type testImage struct {
	URL    string `yaml:"url"`
	SHA256 string `yaml:"sha256"`
}

func (c *testConfig) Defaults() {
	if c.Timeout == 0 {
		c.Timeout = agentconfig.Duration(time.Minute)
	}
}

func (c *testConfig) Check(e *agentconfig.Error) {
	if len(c.Entries) == 0 {
		e.Add("entries", "list at least one entry")
	}
	for i, en := range c.Entries {
		e.Entry(fmt.Sprintf("entries[%d].name", i), en.Name)
		agentconfig.KeyOf(e, fmt.Sprintf("entries[%d].defaultImage", i), en.DefaultImage, en.Images, fmt.Sprintf("entries[%d].images", i))
	}
}

func TestParseValidAppliesDefaults(t *testing.T) {
	c, err := agentconfig.Parse[testConfig]([]byte(`
entries:
  - name: kvm-home
    capacity: 3
    images:
      debian-12: {url: "https://h/d.qcow2", sha256: abc}
`))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := time.Duration(c.Timeout), time.Minute; got != want {
		t.Errorf("timeout = %v, want the default %v", got, want)
	}
	if got := c.Entries[0].Images["debian-12"].SHA256; got != "abc" {
		t.Errorf("sha256 = %q, want %q", got, "abc")
	}
	c, err = agentconfig.Parse[testConfig]([]byte("timeout: 1m30s\nentries: [{name: a}]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := time.Duration(c.Timeout), 90*time.Second; got != want {
		t.Errorf("timeout = %v, want %v", got, want)
	}
}

func TestParseNamesEveryProblemByPath(t *testing.T) {
	tests := []struct {
		name string
		doc  string
		want []agentconfig.Problem
	}{
		{"unknown key deep in a list", `
entries:
  - name: kvm-home
    images:
      debian-12:
        url: https://h/d.qcow2
        sha265: abc
`, []agentconfig.Problem{{Key: "entries[0].images.debian-12.sha265", Reason: "unknown key (check its spelling and indentation)"}}},
		{"unknown key in a flow mapping", `
entries:
  - {name: a, capacty: 3}
`, []agentconfig.Problem{{Key: "entries[0].capacty", Reason: "unknown key (check its spelling and indentation)"}}},
		{"decode and check problems together", `
timeout: soon
entries:
  - name: Bad_Name
    capacity: lots
    tags: {a: b}
`, []agentconfig.Problem{
			{Key: "timeout", Reason: `must be a duration such as "30s" or "10m", got "soon"`},
			{Key: "entries[0].capacity", Reason: "cannot unmarshal !!str `lots` into int"},
			{Key: "entries[0].tags", Reason: "cannot unmarshal !!map into []string"},
			{Key: "entries[0].name", Reason: `must be ` + events.IdentifierRule + `, got "Bad_Name"`},
		}},
		{"a default naming no key", `
entries:
  - name: a
    defaultImage: debian-13
    images: {debian-12: {url: "https://h/d.qcow2"}}
  - name: b
`, []agentconfig.Problem{{Key: "entries[0].defaultImage", Reason: `names no key of entries[0].images: "debian-13"`}}},
		{"the external pools' entry", `
entries:
  - name: external
`, []agentconfig.Problem{{Key: "entries[0].name", Reason: `"external" is reserved for external pools, whose proxies no agent serves; name the entry otherwise`}}},
		{"a misspelt list is also missing", `
entires: []
`, []agentconfig.Problem{
			{Key: "entires", Reason: "unknown key (check its spelling and indentation)"},
			{Key: "entries", Reason: "list at least one entry"},
		}},
		{"line breaks in a key and a value stay on the problem's line", `
entries:
  - name: a
    "cap\nacity": 3
    capacity: "x\ny"
`, []agentconfig.Problem{
			{Key: `entries[0]."cap\nacity"`, Reason: "unknown key (check its spelling and indentation)"},
			{Key: "entries[0].capacity", Reason: "cannot unmarshal !!str `x\\ny` into int"},
		}},
		{"empty", "\n# nothing\n", []agentconfig.Problem{{Reason: "empty config: the file holds no keys"}}},
		{"two documents", "entries: [{name: a}]\n---\nentries: [{name: b}]\n", []agentconfig.Problem{
			{Reason: `the file holds more than one YAML document (a second "---"): only one is read, so merge them`}}},
		{"not YAML", "entries: [a\n", nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := agentconfig.Parse[testConfig]([]byte(tc.doc))
			e, ok := errors.AsType[*agentconfig.Error](err)
			if !ok || c != nil {
				t.Fatalf("Parse = %v, %v; want no config and an *Error", c, err)
			}
			if tc.want == nil {
				if len(e.Problems) != 1 || e.Problems[0].Key != "" || !strings.HasPrefix(e.Problems[0].Reason, "not a YAML document: ") {
					t.Fatalf("problems = %q, want one about the document", e.Problems)
				}
				return
			}
			if !slices.Equal(e.Problems, tc.want) {
				t.Errorf("problems:\n got %q\nwant %q", e.Problems, tc.want)
			}
		})
	}
}

func TestParseAcceptsDocumentMarkers(t *testing.T) {
	for _, doc := range []string{"---\nentries: [{name: a}]\n", "entries: [{name: a}]\n---\n", "entries: [{name: a}]\n...\n"} {
		if _, err := agentconfig.Parse[testConfig]([]byte(doc)); err != nil {
			t.Errorf("Parse(%q) = %v, want one document read", doc, err)
		}
	}
}

func TestLoadNamesTheFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.yaml")
	if err := os.WriteFile(path, []byte("entries: []\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := agentconfig.Load[testConfig](path)
	want := "invalid config " + path + ":\n  entries: list at least one entry"
	if err == nil || err.Error() != want {
		t.Errorf("Load error = %v, want %q", err, want)
	}
	if _, err := agentconfig.Load[testConfig](path + ".missing"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Load of a missing file = %v, want fs.ErrNotExist", err)
	}
}

func TestKeyedAndURL(t *testing.T) {
	var e agentconfig.Error
	var seen []string
	agentconfig.Keyed(&e, "images", map[string]int{"b": 2, "Bad_Key": 1, "a": 0}, func(path string, v int) {
		seen = append(seen, path)
		if v == 0 {
			e.Add(path, "is zero")
		}
	})
	agentconfig.Keyed(&e, "profiles", map[string]string{"ok": ""}, nil)
	e.URL("apiURL", "http://pve:8006", "https")
	e.URL("endpoint", "https:///path", "https", "http")
	e.URL("mirror", "http://mirror/x", "https", "http")
	e.URL("optional", "", "https")
	if want := []string{"images.Bad_Key", "images.a", "images.b"}; !slices.Equal(seen, want) {
		t.Errorf("check called for %v, want %v (sorted)", seen, want)
	}
	var got []string
	for _, p := range e.Problems {
		got = append(got, p.String())
	}
	want := []string{
		`images.Bad_Key: must be 1-63 lowercase letters, digits or '-', starting and ending with a letter or digit, got "Bad_Key"`,
		"images.a: is zero",
		`apiURL: must be an https URL with a host, got "http://pve:8006"`,
		`endpoint: must be an https or http URL with a host, got "https:///path"`,
	}
	if !slices.Equal(got, want) {
		t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func TestLabelsAndTargetLabels(t *testing.T) {
	var e agentconfig.Error
	e.Labels("labels", map[string]string{"region": "eu-west", "country": "de"})
	e.Labels("entries[0].labels", map[string]string{"Region": "eu", "provider": "Hetzner", "zone": ""})
	e.TargetLabels("entries[0].targetLabels", map[string]map[string]string{
		"europe-west1-b": {"region": "eu-west"},
		"us-east1-c":     {"region": "us east"},
		"nowhere":        {"region": "eu"},
	}, []string{"europe-west1-b", "us-east1-c"})
	var got []string
	for _, p := range e.Problems {
		got = append(got, p.String())
	}
	rule := events.LabelRule
	want := []string{
		`entries[0].labels: every key must be ` + rule + `, got "Region"`,
		`entries[0].labels.provider: must be ` + rule + `, got "Hetzner"`,
		`entries[0].labels.zone: must be ` + rule + `, got ""`,
		`entries[0].targetLabels.nowhere: names no listed target; the targets are europe-west1-b, us-east1-c`,
		`entries[0].targetLabels.us-east1-c.region: must be ` + rule + `, got "us east"`,
	}
	if !slices.Equal(got, want) {
		t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
