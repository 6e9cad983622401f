package pvetest

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"proxyfleet/pkg/testgate"
)

// SchemaRelPath is where the Proxmox VE API schema lies, relative to the
// directory that holds the project's checkout and its shared reference
// material.
const SchemaRelPath = "shared/reference/proxmox/pve-api-schema.json"

// Schema is the published Proxmox VE API schema: path → method → parameters.
type Schema map[string]map[string]struct {
	Parameters struct {
		Properties map[string]json.RawMessage `json:"properties"`
	} `json:"parameters"`
}

// LoadSchema finds the schema by walking up from the working directory and
// loads it. It skips t when the file is absent, or fails it when
// PROXYFLEET_REQUIRE_INTEGRATION=1.
func LoadSchema(t testing.TB) Schema {
	t.Helper()
	path := findSchema()
	testgate.NeedFile(t, path, "the Proxmox VE API schema is read from "+SchemaRelPath+" beside the project root")
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var s Schema
	if err := json.Unmarshal(raw, &s); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return s
}

func findSchema() string {
	dir, err := os.Getwd()
	if err != nil {
		return SchemaRelPath
	}
	for {
		p := filepath.Join(dir, SchemaRelPath)
		if _, err := os.Stat(p); err == nil {
			return p
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return SchemaRelPath
		}
		dir = parent
	}
}

var indexedParam = regexp.MustCompile(`^([a-z]+)(\d+)$`)

// Check reports an error unless method on route exists in the schema and
// accepts every parameter in params (net0 is checked as net[n]).
func (s Schema) Check(method, route string, params []string) error {
	methods, ok := s[route]
	if !ok {
		return fmt.Errorf("%s %s: path not in the schema", method, route)
	}
	m, ok := methods[method]
	if !ok {
		return fmt.Errorf("%s %s: method not in the schema", method, route)
	}
	var missing []string
	for _, p := range params {
		if _, ok := m.Parameters.Properties[p]; ok {
			continue
		}
		if g := indexedParam.FindStringSubmatch(p); g != nil {
			if _, ok := m.Parameters.Properties[g[1]+"[n]"]; ok {
				continue
			}
		}
		missing = append(missing, p)
	}
	if len(missing) > 0 {
		return fmt.Errorf("%s %s: parameters not in the schema: %s", method, route, strings.Join(missing, ", "))
	}
	return nil
}

// MatchRoute returns the schema path of the fake route serving method on
// the escaped API path p (below /api2/json).
func MatchRoute(method, p string) (string, bool) {
	rt, _, _ := match(method, p)
	if rt == nil {
		return "", false
	}
	return rt.path, true
}
