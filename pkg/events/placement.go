package events

import (
	"fmt"
	"maps"
	"slices"
)

// Placement limits: how many required labels and spreads a pool may have,
// and how many values each may list.
const (
	MaxPlacementLabels = MaxLabels
	MaxPlacementValues = 64
	// MaxSpreadWeight bounds one weight of a spread.
	MaxSpreadWeight = 1_000_000
	// MaxPlacementEntries bounds [Placement.Entries].
	MaxPlacementEntries = 16
)

// Placement steers which targets take a pool's proxies by the targets'
// labels (see [LabelRule]): Require keeps the pool on targets whose labels
// hold one of the listed values for each key; Spread shares the pool out
// over the values of a label by weight. Entries widens the pool to the
// targets of further provider entries besides its provider. New proxies
// follow them (fills, replacements, rotations), and the planner moves
// existing ones, one at a time and surge first, when the pool is off its
// weighted shares or holds proxies its placement no longer accepts.
type Placement struct {
	// Entries lists provider entries whose targets take the pool's
	// proxies besides those of the pool's provider (which stays
	// required); require and spread apply across all of them, and the
	// pool's targets, when set, name targets of any of them.
	Entries []string `json:"entries,omitempty"`
	// Require maps a label key to the values a target must carry one of
	// ({"country": ["de", "fr"]}).
	Require map[string][]string `json:"require,omitempty"`
	// Spread lists labels to share the pool out over, the first
	// deciding first.
	Spread []Spread `json:"spread,omitempty"`
}

// Spread shares a pool out over the values of Label: each value's share
// of the pool is its weight over the sum of Weights. A new proxy goes to
// the value furthest below its share (of those with a target that can
// take it); a target without the label, or with a value not in Weights,
// takes none of the pool's proxies.
type Spread struct {
	Label   string         `json:"label"`
	Weights map[string]int `json:"weights"`
}

// Clone returns a copy of p that shares nothing with it.
func (p *Placement) Clone() *Placement {
	if p == nil {
		return nil
	}
	out := &Placement{Entries: slices.Clone(p.Entries)}
	if p.Require != nil {
		out.Require = make(map[string][]string, len(p.Require))
		for k, vs := range p.Require {
			out.Require[k] = slices.Clone(vs)
		}
	}
	for _, s := range p.Spread {
		out.Spread = append(out.Spread, Spread{Label: s.Label, Weights: maps.Clone(s.Weights)})
	}
	return out
}

// Matches reports whether labels satisfy p's Require.
func (p *Placement) Matches(labels map[string]string) bool {
	if p == nil {
		return true
	}
	for k, vs := range p.Require {
		v, ok := labels[k]
		if !ok || !slices.Contains(vs, v) {
			return false
		}
	}
	return true
}

// validate adds p's problems to v, each named under prefix
// ("placement.spread[1].weights.eu"); provider is the pool's provider.
func (p *Placement) validate(v *ValidationError, prefix, provider string) {
	if len(p.Entries) > MaxPlacementEntries {
		v.Add(prefix+".entries", fmt.Sprintf("may list at most %d entries", MaxPlacementEntries), fmt.Sprint(len(p.Entries)))
	}
	for i, e := range p.Entries {
		f := fmt.Sprintf("%s.entries[%d]", prefix, i)
		switch {
		case !IsIdentifier(e):
			v.AddField(CheckIdentifier(f, e))
		case e == provider:
			v.Add(f, "is the pool's provider already; list only further entries", e)
		case slices.Index(p.Entries, e) < i:
			v.Add(f, "is listed twice", e)
		}
	}
	if len(p.Require) > MaxPlacementLabels {
		v.Add(prefix+".require", fmt.Sprintf("may name at most %d labels", MaxPlacementLabels), fmt.Sprint(len(p.Require)))
	}
	for _, k := range slices.Sorted(maps.Keys(p.Require)) {
		f := prefix + ".require"
		if !IsLabel(k) {
			v.Add(f, "every key must be a label key: "+LabelRule, k)
			continue
		}
		f += "." + k
		vs := p.Require[k]
		if len(vs) == 0 {
			v.Add(f, "must list at least one value", "")
		}
		if len(vs) > MaxPlacementValues {
			v.Add(f, fmt.Sprintf("may list at most %d values", MaxPlacementValues), fmt.Sprint(len(vs)))
		}
		for i, val := range vs {
			fi := fmt.Sprintf("%s[%d]", f, i)
			switch {
			case !IsLabel(val):
				v.Add(fi, "must be a label value: "+LabelRule, val)
			case slices.Index(vs, val) < i:
				v.Add(fi, "is listed twice", val)
			}
		}
	}
	if len(p.Spread) > MaxPlacementLabels {
		v.Add(prefix+".spread", fmt.Sprintf("may list at most %d spreads", MaxPlacementLabels), fmt.Sprint(len(p.Spread)))
	}
	for i, s := range p.Spread {
		f := fmt.Sprintf("%s.spread[%d]", prefix, i)
		switch {
		case s.Label == "":
			v.Add(f+".label", "is required", "")
		case !IsLabel(s.Label):
			v.Add(f+".label", "must be a label key: "+LabelRule, s.Label)
		case slices.IndexFunc(p.Spread[:i], func(o Spread) bool { return o.Label == s.Label }) >= 0:
			v.Add(f+".label", "spreads over a label an earlier spread already spreads over; merge their weights", s.Label)
		}
		if len(s.Weights) == 0 {
			v.Add(f+".weights", "must give at least one label value a weight", "")
		}
		if len(s.Weights) > MaxPlacementValues {
			v.Add(f+".weights", fmt.Sprintf("may weigh at most %d values", MaxPlacementValues), fmt.Sprint(len(s.Weights)))
		}
		for _, val := range slices.Sorted(maps.Keys(s.Weights)) {
			if !IsLabel(val) {
				v.Add(f+".weights", "every key must be a label value: "+LabelRule, val)
				continue
			}
			if w := s.Weights[val]; w < 1 || w > MaxSpreadWeight {
				v.Add(f+".weights."+val, fmt.Sprintf("must be a whole number from 1 to %d", MaxSpreadWeight), fmt.Sprint(w))
			}
		}
		if vs, ok := p.Require[s.Label]; ok && IsLabel(s.Label) {
			for _, val := range slices.Sorted(maps.Keys(s.Weights)) {
				if IsLabel(val) && !slices.Contains(vs, val) {
					v.Add(f+".weights."+val, "weighs a value that placement.require."+s.Label+" excludes", val)
				}
			}
		}
	}
}

// PlacementEntries lists the provider entries whose targets may take the
// pool's proxies: its provider, then its placement's further entries.
func (p PoolSpec) PlacementEntries() []string {
	if p.Placement == nil || len(p.Placement.Entries) == 0 {
		return []string{p.Provider}
	}
	return append([]string{p.Provider}, p.Placement.Entries...)
}
