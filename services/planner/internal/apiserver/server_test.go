package apiserver

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"proxyfleet/pkg/agent"
	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// fakeBackend is a planner that knows entry "local" with targets t1 and t2,
// pool "demo" and proxy "demo-aaaaaaaaaa" (ready, with instance
// px-demo-aaaaaaaaaa on local/t1), and records what it is asked to decide.
type fakeBackend struct {
	decided []string
}

const fakeProxy = "demo-aaaaaaaaaa"

func (f *fakeBackend) Pool(name string) (api.PoolView, bool) {
	return api.PoolView{Name: name, Revision: 1}, name == "demo"
}

func (f *fakeBackend) Pools(after string, n int) []api.PoolView { return nil }

func (f *fakeBackend) Proxies(pool, after string, n int) []events.ProxyView { return nil }

func (f *fakeBackend) Proxy(_ context.Context, id string) (events.ProxyView, *api.APIError) {
	if id != fakeProxy {
		return events.ProxyView{}, api.NotFound("id", "unknown proxy", id)
	}
	return events.ProxyView{ID: id, Pool: "demo", State: events.ProxyReady}, nil
}

func (f *fakeBackend) Targets(_ context.Context, entry string, _ []string) (map[string]bool, bool) {
	if entry != "local" {
		return map[string]bool{}, false
	}
	return map[string]bool{"t1": true, "t2": true}, true
}

func (f *fakeBackend) LabelKeys(_ context.Context, entry string) (map[string]bool, bool) {
	if entry != "local" {
		return nil, false
	}
	return map[string]bool{"region": true}, true
}

func (f *fakeBackend) Inventory(_ context.Context, entry, target string) ([]agent.Instance, error) {
	return []agent.Instance{
		{Name: events.InstanceName(fakeProxy), Marker: agent.Marker{ProxyID: fakeProxy, Pool: "demo", Entry: "local"}},
		{Name: "px-other", Marker: agent.Marker{ProxyID: fakeProxy, Pool: "demo", Entry: "kvm"}},
	}, nil
}

func (f *fakeBackend) ApplyPool(_ context.Context, spec events.PoolSpec) (api.PoolView, *api.APIError) {
	f.decided = append(f.decided, fmt.Sprintf("apply %s size %d port %d", spec.Name, spec.Size, spec.Port))
	return api.PoolView{Name: spec.Name}, nil
}

func (f *fakeBackend) DeletePool(_ context.Context, name string) (api.PoolView, *api.APIError) {
	f.decided = append(f.decided, "delete pool "+name)
	return api.PoolView{Name: name}, nil
}

func (f *fakeBackend) Retire(_ context.Context, id string, r Retirement) (events.ProxyView, *api.APIError) {
	f.decided = append(f.decided, fmt.Sprintf("retire %s %q skipCleanup=%v replace=%v", id, r.Reason, r.SkipCleanup, r.Replace))
	return events.ProxyView{ID: id}, nil
}

func (f *fakeBackend) Recycle(_ context.Context, id string) (events.ProxyView, *api.APIError) {
	f.decided = append(f.decided, "recycle "+id)
	return events.ProxyView{ID: id}, nil
}

func (f *fakeBackend) DeleteInstance(_ context.Context, entry, target string, inst agent.Instance) (int, *api.APIError) {
	f.decided = append(f.decided, "delete instance "+entry+"/"+target+"/"+inst.Name)
	return 1, nil
}

// TestEndpointsHandTheWriterOnlyWhatTheyChecked: every endpoint refuses a
// request it cannot accept before the writer sees it, and hands an
// accepted one over as the contract says (reasons, defaults, flags).
func TestEndpointsHandTheWriterOnlyWhatTheyChecked(t *testing.T) {
	for _, tc := range []struct {
		name, endpoint, body string
		status, field        string // of the refusal; "" for an accepted request
		decided              string // what the writer was asked, for an accepted one
	}{
		{"apply", "pool.apply", `{"name":"demo","provider":"local","targets":["t2"],"size":2}`, "", "", "apply demo size 2 port 3128"},
		{"apply without size", "pool.apply", `{"name":"demo","provider":"local"}`, "422", "size", ""},
		{"apply to an entry no agent announced yet", "pool.apply", `{"name":"demo","provider":"kvm","targets":["h1"],"size":1}`, "", "", "apply demo size 1 port 3128"},
		{"apply to a malformed entry", "pool.apply", `{"name":"demo","provider":"KVM","size":1}`, "422", "provider", ""},
		{"apply to an unknown target", "pool.apply", `{"name":"demo","provider":"local","targets":["t9"],"size":1}`, "422", "targets[0]", ""},
		{"apply spread over a known label", "pool.apply", `{"name":"demo","provider":"local","size":1,"placement":{"spread":[{"label":"region","weights":{"eu":1}}]}}`, "", "", "apply demo size 1 port 3128"},
		{"apply spread over an unknown label", "pool.apply", `{"name":"demo","provider":"local","size":1,"placement":{"spread":[{"label":"zone","weights":{"a":1}}]}}`, "422", "placement.spread[0].label", ""},
		{"apply requiring an unknown label", "pool.apply", `{"name":"demo","provider":"local","size":1,"placement":{"require":{"zone":["a"]}}}`, "422", "placement.require.zone", ""},
		{"apply a placement to an entry no agent announced yet", "pool.apply", `{"name":"demo","provider":"kvm","size":1,"placement":{"require":{"zone":["a"]}}}`, "", "", "apply demo size 1 port 3128"},
		{"apply with an unknown field", "pool.apply", `{"name":"demo","provider":"local","size":1,"sise":2}`, "400", "sise", ""},
		{"delete pool", "pool.delete", `{"name":"demo"}`, "", "", "delete pool demo"},
		{"delete a bad pool name", "pool.delete", `{"name":"Demo!"}`, "422", "name", ""},
		{"get an unknown pool", "pool.get", `{"name":"nope"}`, "422", "name", ""},
		{"list an unknown pool's proxies", "proxy.list", `{"pool":"nope"}`, "422", "pool", ""},
		{"list with a bad limit", "proxy.list", `{"limit":0}`, "422", "limit", ""},
		{"delete", "proxy.delete", `{"id":"` + fakeProxy + `"}`, "", "", `retire ` + fakeProxy + ` "deleted by operator" skipCleanup=false replace=false`},
		{"delete, cleanup skipped", "proxy.delete", `{"id":"` + fakeProxy + `","skipCleanup":true}`, "", "", `retire ` + fakeProxy + ` "deleted by operator, cleanup skipped" skipCleanup=true replace=false`},
		{"delete a bad id", "proxy.delete", `{"id":"../x"}`, "422", "id", ""},
		{"recycle", "proxy.recycle", `{"id":"` + fakeProxy + `"}`, "", "", "recycle " + fakeProxy},
		{"recycle now", "proxy.recycle", `{"id":"` + fakeProxy + `","now":true}`, "", "", `retire ` + fakeProxy + ` "recycled by operator" skipCleanup=false replace=false`},
		{"ban", "proxy.report-ban", `{"id":"` + fakeProxy + `","reason":" 403 from example.org "}`, "", "", `retire ` + fakeProxy + ` "banned: 403 from example.org" skipCleanup=false replace=true`},
		{"ban without a reason", "proxy.report-ban", `{"id":"` + fakeProxy + `"}`, "", "", `retire ` + fakeProxy + ` "banned: reported" skipCleanup=false replace=true`},
		{"ban with a reason too long", "proxy.report-ban", `{"id":"` + fakeProxy + `","reason":"` + strings.Repeat("x", api.MaxBanReason+1) + `"}`, "422", "reason", ""},
		{"instance of a live proxy", "instance.delete", `{"entry":"local","target":"t1","name":"` + events.InstanceName(fakeProxy) + `"}`, "422", "name", ""},
		{"instance of another entry", "instance.delete", `{"entry":"local","target":"t1","name":"px-other"}`, "422", "name", ""},
		{"instance not listed", "instance.delete", `{"entry":"local","target":"t1","name":"px-none"}`, "422", "name", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeBackend{}
			s := &Server{b: f, log: slog.New(slog.DiscardHandler)}
			handlers := map[string]handlerFunc{
				"pool.apply": s.poolApply, "pool.get": s.poolGet, "pool.delete": s.poolDelete, "proxy.list": s.proxyList,
				"proxy.delete": s.proxyDelete, "proxy.recycle": s.proxyRecycle, "proxy.report-ban": s.proxyReportBan,
				"instance.delete": s.instanceDelete,
			}
			_, aerr := handlers[tc.endpoint](context.Background(), []byte(tc.body))
			if tc.status != "" {
				if aerr == nil || aerr.Status != tc.status || len(aerr.Fields) == 0 || aerr.Fields[0].Field != tc.field {
					t.Fatalf("got %+v, want a %s naming %s", aerr, tc.status, tc.field)
				}
				if len(f.decided) != 0 {
					t.Errorf("a refused request reached the writer: %q", f.decided)
				}
				return
			}
			if aerr != nil {
				t.Fatalf("refused: %+v", aerr)
			}
			if len(f.decided) != 1 || f.decided[0] != tc.decided {
				t.Errorf("the writer was asked %q, want %q", f.decided, tc.decided)
			}
		})
	}
}
