package e2e_test

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestBadInputChangesNothing sends every kind of bad request to the real
// planner: each gets a structured 400/422 naming the field, and no event is
// appended.
func TestBadInputChangesNothing(t *testing.T) {
	f := startFleet(t)
	cases := []struct {
		name, subject, body, field string
	}{
		{"malformed json", "fleet.api.pool.apply", `{"name":"x",`, ""},
		{"wrong type", "fleet.api.pool.apply", `{"name":"x","provider":"local","size":"three"}`, "size"},
		{"bad name", "fleet.api.pool.apply", `{"name":"Bad_Name","provider":"local","size":1}`, "name"},
		{"negative size", "fleet.api.pool.apply", `{"name":"x","provider":"local","size":-1}`, "size"},
		{"malformed provider", "fleet.api.pool.apply", `{"name":"x","provider":"No Where","size":1}`, "provider"},
		{"unknown pool get", "fleet.api.pool.get", `{"name":"nope"}`, "name"},
		{"unknown pool delete", "fleet.api.pool.delete", `{"name":"nope"}`, "name"},
	}
	before := f.intentEvents()
	for _, c := range cases {
		r := f.req(c.subject, c.body, nil)
		if r.Code != "400" && r.Code != "422" {
			t.Errorf("%s: error code %q, want 400 or 422 (body %s)", c.name, r.Code, r.Data)
			continue
		}
		var body struct {
			Error struct {
				Message string `json:"message"`
				Fields  []struct {
					Field string `json:"field"`
				} `json:"fields"`
			} `json:"error"`
		}
		if err := json.Unmarshal(r.Data, &body); err != nil || body.Error.Message == "" {
			t.Errorf("%s: body is not a structured error: %s", c.name, r.Data)
			continue
		}
		if c.field != "" {
			found := strings.Contains(body.Error.Message, c.field)
			for _, fe := range body.Error.Fields {
				found = found || fe.Field == c.field
			}
			if !found {
				t.Errorf("%s: error %s does not name field %q", c.name, r.Data, c.field)
			}
		}
	}
	if after := f.intentEvents(); after != before {
		t.Fatalf("bad input appended events: %d -> %d events", before, after)
	}
}
