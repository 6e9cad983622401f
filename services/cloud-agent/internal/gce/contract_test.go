package gce

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"google.golang.org/api/compute/v1"
	"google.golang.org/api/googleapi"

	"proxyfleet/pkg/agent"
)

// discovery is the part of a discovery document the contract test reads.
type discovery struct {
	Parameters map[string]json.RawMessage `json:"parameters"`
	Resources  map[string]struct {
		Methods map[string]struct {
			ID         string                     `json:"id"`
			HTTPMethod string                     `json:"httpMethod"`
			Path       string                     `json:"path"`
			Parameters map[string]json.RawMessage `json:"parameters"`
			Response   struct {
				Ref string `json:"$ref"`
			} `json:"response"`
		} `json:"methods"`
	} `json:"resources"`
	Schemas map[string]*schema `json:"schemas"`
}

type schema struct {
	Ref                  string             `json:"$ref"`
	Type                 string             `json:"type"`
	Properties           map[string]*schema `json:"properties"`
	Items                *schema            `json:"items"`
	AdditionalProperties *schema            `json:"additionalProperties"`
}

// loadDiscovery reads compute/v1/compute-api.json from the module cache
// copy of google.golang.org/api this module builds with.
func loadDiscovery(t *testing.T) *discovery {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-json", "google.golang.org/api").Output()
	if err != nil {
		t.Fatalf("go list -m google.golang.org/api: %v", err)
	}
	var mod struct{ Dir, Version string }
	if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
		t.Fatalf("go list -m: no module directory (%v): %s", err, out)
	}
	b, err := os.ReadFile(filepath.Join(mod.Dir, "compute", "v1", "compute-api.json"))
	if err != nil {
		t.Fatalf("discovery document: %v", err)
	}
	var d discovery
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	return &d
}

// TestContractAgainstDiscovery runs every call the driver makes against the
// fake, then checks that each route the fake served exists in the
// discovery document with that method and path, that every query parameter
// the client sent is declared, and that every fake response decodes into
// the compute types and uses only properties the schema declares.
func TestContractAgainstDiscovery(t *testing.T) {
	d := loadDiscovery(t)
	byID := map[string]struct{ method, path string }{}
	params := map[string][]string{}
	responses := map[string]string{}
	for _, r := range d.Resources {
		for _, m := range r.Methods {
			byID[m.ID] = struct{ method, path string }{m.HTTPMethod, m.Path}
			for p := range m.Parameters {
				params[m.ID] = append(params[m.ID], p)
			}
			for p := range d.Parameters {
				params[m.ID] = append(params[m.ID], p)
			}
			responses[m.ID] = m.Response.Ref
		}
	}
	routes := map[string]*regexp.Regexp{}
	for id, r := range fakeRoutes {
		got, ok := byID[id]
		if !ok {
			t.Fatalf("fake route %s is not in the discovery document", id)
		}
		if got.method != r[0] || got.path != r[1] {
			t.Fatalf("fake route %s = %s %s, discovery says %s %s", id, r[0], r[1], got.method, got.path)
		}
		tmpl := regexp.MustCompile(`\{[a-zA-Z]+\}`).ReplaceAllString(r[1], "\x00")
		routes[id] = regexp.MustCompile("^" + strings.ReplaceAll(regexp.QuoteMeta(tmpl), "\x00", "[^/]+") + "$")
	}

	// Exercise every call the driver makes, including errors.
	f := newFakeCompute(t, "zone-a", "zone-b")
	f.pageSize = 1
	drv := newDriver(t, f, "zone-a", []string{"zone-a", "zone-b"}, nil)
	s := spec("px-contract", 1)
	ref := createRunning(t, drv, s)
	if _, err := drv.Create(ctx(t), spec("px-contract-2", 1)); err != nil {
		t.Fatal(err)
	}
	if _, err := drv.Create(ctx(t), s); err != nil { // repeated requestId
		t.Fatal(err)
	}
	if list, err := drv.List(ctx(t)); err != nil || len(list) != 2 {
		t.Fatalf("list = %v, %v", list, err)
	}
	drv.Check(ctx(t))
	stopBehindTheBack(t, drv, "zone-a", s.Name)
	f.failInsertOp("zone-a", codeStockout)
	if _, err := drv.Create(ctx(t), spec("px-contract-3", 1)); !errors.Is(err, agent.ErrQuotaExceeded) {
		t.Fatalf("stockout: %v", err)
	}
	if err := drv.Delete(ctx(t), ref); err != nil {
		t.Fatal(err)
	}
	if err := drv.Delete(ctx(t), ref); !errors.Is(err, agent.ErrNotFound) {
		t.Fatalf("delete again: %v", err)
	}

	seen := map[string]bool{}
	for _, req := range f.recorded() {
		id := ""
		for rid, re := range routes {
			if re.MatchString(req.Path) && fakeRoutes[rid][0] == req.Method {
				id = rid
			}
		}
		if id == "" {
			t.Errorf("client called %s %s, which no discovery route matches", req.Method, req.Path)
			continue
		}
		seen[id] = true
		for _, q := range req.Query {
			if !slices.Contains(params[id], q) {
				t.Errorf("%s: query parameter %q is not declared in the discovery document", id, q)
			}
		}
		if req.Status >= 300 {
			checkErrorBody(t, id, req)
			continue
		}
		want := responses[id]
		if req.Kind != want {
			t.Errorf("%s: fake answered a %s, discovery says %s", id, req.Kind, want)
		}
		decodeStrict(t, id, want, req.Body)
		var v any
		if err := json.Unmarshal(req.Body, &v); err != nil {
			t.Fatal(err)
		}
		checkSchema(t, d, id, want, d.Schemas[want], v)
	}
	for id := range fakeRoutes {
		if !seen[id] {
			t.Errorf("route %s was never exercised", id)
		}
	}
}

func decodeStrict(t *testing.T, id, kind string, body []byte) {
	t.Helper()
	var target any
	switch kind {
	case "Operation":
		target = &compute.Operation{}
	case "Instance":
		target = &compute.Instance{}
	case "InstanceList":
		target = &compute.InstanceList{}
	case "InstanceAggregatedList":
		target = &compute.InstanceAggregatedList{}
	default:
		t.Fatalf("%s: no compute type for %s", id, kind)
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(target); err != nil {
		t.Errorf("%s: response does not decode into compute.%s: %v", id, kind, err)
	}
}

func checkErrorBody(t *testing.T, id string, req fakeRequest) {
	t.Helper()
	resp := &http.Response{StatusCode: req.Status, Body: io.NopCloser(bytes.NewReader(req.Body)), Header: http.Header{}}
	err := googleapi.CheckResponse(resp)
	var ge *googleapi.Error
	if !errors.As(err, &ge) || ge.Code != req.Status || len(ge.Errors) == 0 || ge.Errors[0].Reason == "" {
		t.Errorf("%s: error body does not parse as a googleapi error with a reason: %v", id, err)
	}
}

// checkSchema walks a JSON value and reports properties the discovery
// schema does not declare.
func checkSchema(t *testing.T, d *discovery, id, at string, s *schema, v any) {
	t.Helper()
	for s != nil && s.Ref != "" {
		s = d.Schemas[s.Ref]
	}
	if s == nil {
		return
	}
	switch x := v.(type) {
	case map[string]any:
		for k, val := range x {
			switch {
			case s.Properties != nil:
				p, ok := s.Properties[k]
				if !ok {
					t.Errorf("%s: %s.%s is not in the discovery schema", id, at, k)
					continue
				}
				checkSchema(t, d, id, at+"."+k, p, val)
			case s.AdditionalProperties != nil:
				checkSchema(t, d, id, at+"["+k+"]", s.AdditionalProperties, val)
			default:
				t.Errorf("%s: %s is an object the schema does not describe", id, at)
			}
		}
	case []any:
		for _, e := range x {
			checkSchema(t, d, id, at+"[]", s.Items, e)
		}
	}
}
