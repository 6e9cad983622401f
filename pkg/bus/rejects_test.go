package bus_test

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"proxyfleet/pkg/bus"
	"proxyfleet/pkg/events"
)

// Each offending aggregate is logged once per problem, and the memory of
// what was logged stays within its limit.
func TestRejectsReportsOncePerAggregate(t *testing.T) {
	var buf bytes.Buffer
	r := bus.NewRejects(slog.New(slog.NewTextHandler(&buf, nil)), 2)
	badID := events.CheckEvent(events.AggregateProxy, "Bad", events.ProxyRunning, "test", events.Observer{})
	badSource := events.CheckEvent(events.AggregateProxy, "good", events.ProxyRunning, "test", events.Observer{})
	steps := []struct {
		seq    uint64
		id     string
		fe     *events.FieldError
		logged bool
	}{
		{1, "Bad", badID, true},
		{2, "Bad", badID, false},
		{3, "good", badSource, true},
		{4, "good", badSource, false},
		{5, "Bad", badID, false},
		// A third key fills the set past its limit of 2: it is cleared.
		{6, "Other", badID, true},
		{7, "Bad", badID, true},
		{8, "Other", badID, false},
	}
	for _, s := range steps {
		if got := r.Report(s.seq, events.AggregateProxy, s.id, events.ProxyRunning, "test", s.fe); got != s.logged {
			t.Errorf("Report(seq %d, %q, %s) = %v; want %v", s.seq, s.id, s.fe.Field, got, s.logged)
		}
	}
	if got, want := strings.Count(buf.String(), "skipping events"), 4; got != want {
		t.Errorf("%d log lines; want %d:\n%s", got, want, buf.String())
	}
}
