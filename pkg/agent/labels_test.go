package agent_test

import (
	"errors"
	"flag"
	"io"
	"maps"
	"strings"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/events"
)

func TestNewRefusesBadLabels(t *testing.T) {
	_, err := agent.New(nil, nil, agent.Config{Info: agent.Info{Entry: "mem", Target: "t1",
		Labels: map[string]string{"region": "EU"}}}, nil, nil)
	var v *events.ValidationError
	if !errors.As(err, &v) || len(v.Fields) != 1 || v.Fields[0].Field != "labels.region" {
		t.Fatalf("New with a bad label = %v; want the problem of labels.region", err)
	}
}

func TestLabelsFlag(t *testing.T) {
	cases := []struct {
		args []string
		want map[string]string
		err  string
	}{
		{args: nil, want: nil},
		{args: []string{"--labels", "region=eu-west,country=de"}, want: map[string]string{"region": "eu-west", "country": "de"}},
		{args: []string{"--labels", "region=eu", "--labels", "country=fr"}, want: map[string]string{"country": "fr"}},
		{args: []string{"--labels", "region:eu"}, err: `invalid value "region:eu" for flag -labels: invalid: labels: each label must be key=value (got "region:eu")`},
		{args: []string{"--labels", "region=Eu"}, err: `flag -labels: invalid: labels.region: must be ` + events.LabelRule + ` (got "Eu")`},
	}
	for _, tc := range cases {
		fs := flag.NewFlagSet("agent", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		got := agent.LabelsFlag(fs)
		err := fs.Parse(tc.args)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: error %v, want one containing %q", tc.args, err, tc.err)
			}
			continue
		}
		if err != nil || !maps.Equal(*got, tc.want) {
			t.Errorf("%q: labels %v, err %v; want %v", tc.args, *got, err, tc.want)
		}
	}
}

// The entry of external pools is no agent's.
func TestNewRefusesTheExternalEntry(t *testing.T) {
	_, err := agent.New(nil, nil, agent.Config{Info: agent.Info{Entry: events.ProviderExternal, Target: "t1"}}, nil, nil)
	var v *events.ValidationError
	if !errors.As(err, &v) || len(v.Fields) != 1 || v.Fields[0].Field != "entry" || !strings.Contains(v.Fields[0].Reason, "reserved for external pools") {
		t.Fatalf("New serving entry external = %v; want the problem of entry, reserved", err)
	}
}
