package events

import (
	"errors"
	"maps"
	"strings"
	"testing"
	"time"
)

func TestParseLabels(t *testing.T) {
	many := make([]string, 17)
	for i := range many {
		many[i] = string(rune('a'+i)) + "=1"
	}
	cases := []struct {
		in   string
		want map[string]string
		// field and value of the first problem; "" when in is valid.
		field, value, reason string
	}{
		{in: "", want: map[string]string{}},
		{in: "  ", want: map[string]string{}},
		{in: "region=eu-west", want: map[string]string{"region": "eu-west"}},
		{in: "region=eu-west, country=de ,provider=hetzner_1", want: map[string]string{"region": "eu-west", "country": "de", "provider": "hetzner_1"}},
		{in: "k_1=" + strings.Repeat("v", 63), want: map[string]string{"k_1": strings.Repeat("v", 63)}},
		{in: "region", field: "labels", value: "region", reason: "key=value"},
		{in: "region=eu,region=us", field: "labels", value: "region=us", reason: "twice"},
		{in: "Region=eu", field: "labels", value: "Region", reason: LabelRule},
		{in: "=eu", field: "labels", value: "", reason: LabelRule},
		{in: "region=EU", field: "labels.region", value: "EU", reason: LabelRule},
		{in: "region=", field: "labels.region", value: "", reason: LabelRule},
		{in: "region=eu.west", field: "labels.region", value: "eu.west", reason: LabelRule},
		{in: strings.Repeat("k", 64) + "=v", field: "labels", value: strings.Repeat("k", 64), reason: LabelRule},
		{in: "k=" + strings.Repeat("v", 64), field: "labels.k", value: strings.Repeat("v", 64), reason: LabelRule},
		{in: strings.Join(many, ","), field: "labels", reason: "at most 16"},
	}
	for _, tc := range cases {
		got, err := ParseLabels(tc.in)
		if tc.field == "" {
			if err != nil || !maps.Equal(got, tc.want) {
				t.Errorf("ParseLabels(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
			}
			continue
		}
		var v *ValidationError
		if !errors.As(err, &v) || len(v.Fields) == 0 {
			t.Errorf("ParseLabels(%q) = %v, %v; want a validation error", tc.in, got, err)
			continue
		}
		fe := v.Fields[0]
		if fe.Field != tc.field || fe.Value != tc.value || !strings.Contains(fe.Reason, tc.reason) {
			t.Errorf("ParseLabels(%q): first problem %+v; want field %q, value %q, reason with %q", tc.in, fe, tc.field, tc.value, tc.reason)
		}
	}
}

func TestFormatLabelsRoundTrips(t *testing.T) {
	in := map[string]string{"region": "eu-west", "country": "de"}
	s := FormatLabels(in)
	if s != "country=de,region=eu-west" {
		t.Errorf("FormatLabels = %q, want keys in order", s)
	}
	out, err := ParseLabels(s)
	if err != nil || !maps.Equal(out, in) {
		t.Errorf("ParseLabels(FormatLabels) = %v, %v; want %v", out, err, in)
	}
}

func TestMergeLabels(t *testing.T) {
	base := map[string]string{"provider": "gce", "region": "eu"}
	got := MergeLabels(base, map[string]string{"region": "eu-west", "zone": "b"})
	want := map[string]string{"provider": "gce", "region": "eu-west", "zone": "b"}
	if !maps.Equal(got, want) {
		t.Errorf("MergeLabels = %v, want %v", got, want)
	}
	if base["region"] != "eu" {
		t.Error("MergeLabels changed its base")
	}
	if MergeLabels(nil, map[string]string{}) != nil {
		t.Error("MergeLabels of nothing is not nil")
	}
}

func TestRequestedDataChecksLabels(t *testing.T) {
	d := ProxyRequestedData{ProxySpec: ProxySpec{Pool: "p", Entry: "e", Target: "t", Instance: "px-1"},
		Labels: map[string]string{"region": "EU"}}
	err := d.Validate()
	var v *ValidationError
	if !errors.As(err, &v) || len(v.Fields) != 1 || v.Fields[0].Field != "labels.region" {
		t.Fatalf("Validate = %v; want one problem of labels.region", err)
	}
	d.Labels["region"] = "eu"
	if err := d.Validate(); err != nil {
		t.Errorf("Validate of good labels = %v", err)
	}
}

func TestProxyViewCarriesRequestedLabels(t *testing.T) {
	d := ProxyRequestedData{ProxySpec: ProxySpec{Pool: "p", Entry: "e", Target: "t", Instance: "px-1"},
		Labels: map[string]string{"region": "eu"}}
	v := NewProxyView("p-1", "p-1.requested.1", 1, time.Unix(1700000000, 0), d)
	d.Labels["region"] = "us"
	if v.Labels["region"] != "eu" {
		t.Errorf("view labels = %v, want its own copy of region=eu", v.Labels)
	}
}
