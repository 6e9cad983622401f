package agent

import (
	"flag"

	"proxyfleet/pkg/events"
)

// LabelsFlag registers --labels on fs: the target's labels
// ("region=eu-west,country=de"), announced in [Info.Labels]. A bad label
// fails the flag parse with the rule it breaks.
func LabelsFlag(fs *flag.FlagSet) *map[string]string {
	v := &labelsValue{}
	fs.Var(v, "labels",
		"labels of this target, key=value[,key=value] (keys and values: "+events.LabelRule+"; at most 16), e.g. region=eu-west,country=de,provider=hetzner; the planner records them on every proxy placed here")
	return &v.m
}

type labelsValue struct{ m map[string]string }

func (v *labelsValue) String() string {
	if v == nil {
		return ""
	}
	return events.FormatLabels(v.m)
}

// Set replaces the labels: the flag is given once, whole.
func (v *labelsValue) Set(s string) error {
	m, err := events.ParseLabels(s)
	if err != nil {
		return err
	}
	v.m = m
	return nil
}
