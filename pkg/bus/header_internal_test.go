package bus

import (
	"reflect"
	"testing"

	"github.com/nats-io/nats.go"
)

func TestParseHeaderKeepsCaseAndValues(t *testing.T) {
	got := parseHeader([]byte("NATS/1.0\r\nNats-TTL: 60s\r\nNats-Msg-Id: a.b\r\nX-Two: 1\r\nX-Two: 2\r\n\r\n"))
	want := nats.Header{"Nats-TTL": {"60s"}, "Nats-Msg-Id": {"a.b"}, "X-Two": {"1", "2"}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("parseHeader: %v, want %v", got, want)
	}
	if h := parseHeader(nil); len(h) != 0 {
		t.Fatalf("no header block: %v", h)
	}
}
