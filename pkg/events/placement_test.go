package events

import (
	"errors"
	"reflect"
	"slices"
	"testing"
)

func TestPlacementValidation(t *testing.T) {
	spec := func(p Placement) PoolSpec {
		return PoolSpec{Name: "p", Provider: "local", Size: 1, Placement: &p}
	}
	cases := []struct {
		name string
		p    Placement
		want []string // the fields named, in order; none: valid
	}{
		{name: "require and spread", p: Placement{Require: map[string][]string{"country": {"de", "fr"}},
			Spread: []Spread{{Label: "region", Weights: map[string]int{"eu": 80, "us": 20}}, {Label: "provider", Weights: map[string]int{"hetzner": 1}}}}},
		{name: "empty", p: Placement{}},
		{name: "bad require key and values", p: Placement{Require: map[string][]string{"Country": {"de"}, "region": {}, "zone": {"a", "B", "a"}}},
			want: []string{"placement.require", "placement.require.region", "placement.require.zone[1]", "placement.require.zone[2]"}},
		{name: "malformed spread labels", p: Placement{Spread: []Spread{{Weights: map[string]int{"eu": 1}}, {Label: "Region", Weights: map[string]int{"eu": 1}}}},
			want: []string{"placement.spread[0].label", "placement.spread[1].label"}},
		{name: "weights that are not positive", p: Placement{Spread: []Spread{{Label: "region", Weights: map[string]int{"eu": 0, "us": -5, "ap": 1, "EU": 1}}}},
			want: []string{"placement.spread[0].weights", "placement.spread[0].weights.eu", "placement.spread[0].weights.us"}},
		{name: "no weights", p: Placement{Spread: []Spread{{Label: "region"}}},
			want: []string{"placement.spread[0].weights"}},
		{name: "spread over a label twice", p: Placement{Spread: []Spread{{Label: "region", Weights: map[string]int{"eu": 1}}, {Label: "region", Weights: map[string]int{"us": 1}}}},
			want: []string{"placement.spread[1].label"}},
		{name: "spread weighs a value require excludes", p: Placement{Require: map[string][]string{"country": {"de"}},
			Spread: []Spread{{Label: "country", Weights: map[string]int{"de": 1, "fr": 1}}}},
			want: []string{"placement.spread[0].weights.fr"}},
		{name: "further entries", p: Placement{Entries: []string{"cloud", "hetzner"}}},
		{name: "entries: malformed, the provider again, twice", p: Placement{Entries: []string{"Cloud", "local", "cloud", "cloud"}},
			want: []string{"placement.entries[0]", "placement.entries[1]", "placement.entries[3]"}},
		{name: "too many entries", p: Placement{Entries: []string{"e1", "e2", "e3", "e4", "e5", "e6", "e7", "e8", "e9", "e10", "e11", "e12", "e13", "e14", "e15", "e16", "e17"}},
			want: []string{"placement.entries"}},
	}
	for _, tc := range cases {
		s := spec(tc.p)
		err := s.Validate()
		var got []string
		var v *ValidationError
		if errors.As(err, &v) {
			for _, f := range v.Fields {
				got = append(got, f.Field)
			}
		} else if err != nil {
			t.Errorf("%s: %v is not a ValidationError", tc.name, err)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: fields %v, want %v (%v)", tc.name, got, tc.want, err)
		}
	}
}

func TestPlacementEntries(t *testing.T) {
	s := PoolSpec{Provider: "local"}
	if got := s.PlacementEntries(); !slices.Equal(got, []string{"local"}) {
		t.Errorf("without a placement: %v, want [local]", got)
	}
	s.Placement = &Placement{Entries: []string{"cloud"}}
	if got := s.PlacementEntries(); !slices.Equal(got, []string{"local", "cloud"}) {
		t.Errorf("with entries: %v, want [local cloud]", got)
	}
	c := s.Placement.Clone()
	c.Entries[0] = "x"
	if s.Placement.Entries[0] != "cloud" {
		t.Error("Clone shares its entries with the original")
	}
}

func TestPlacementMatchesAndClone(t *testing.T) {
	p := &Placement{Require: map[string][]string{"country": {"de", "fr"}, "provider": {"hetzner"}},
		Spread: []Spread{{Label: "region", Weights: map[string]int{"eu": 1}}}}
	for labels, want := range map[string]bool{
		"country=de,provider=hetzner":           true,
		"country=fr,provider=hetzner,region=eu": true,
		"country=us,provider=hetzner":           false,
		"country=de":                            false,
		"":                                      false,
	} {
		m, _ := ParseLabels(labels)
		if got := p.Matches(m); got != want {
			t.Errorf("Matches(%s) = %v, want %v", labels, got, want)
		}
	}
	if !(*Placement)(nil).Matches(nil) {
		t.Error("no placement refuses a target")
	}
	c := p.Clone()
	if !reflect.DeepEqual(c, p) {
		t.Fatalf("Clone = %+v, want %+v", c, p)
	}
	c.Require["country"][0] = "it"
	c.Spread[0].Weights["eu"] = 9
	if p.Require["country"][0] != "de" || p.Spread[0].Weights["eu"] != 1 {
		t.Error("Clone shares with its original")
	}
}
