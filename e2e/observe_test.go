package e2e_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"proxyfleet/pkg/testgate"
	"proxyfleet/pkg/testwait"
)

// metricsTarget is one entry of <run-dir>/metrics-targets.json
// (Prometheus file_sd).
type metricsTarget struct {
	Targets []string          `json:"targets"`
	Labels  map[string]string `json:"labels"`
}

var bannerMetrics = regexp.MustCompile(`(?m)^metrics: (.*)$`)

// bannerMetricsURLs reads the banner's "metrics:" line: service -> URL.
func bannerMetricsURLs(t *testing.T, banner string) map[string]string {
	t.Helper()
	m := bannerMetrics.FindStringSubmatch(banner)
	if m == nil {
		t.Fatalf("no metrics: line in the banner:\n%s", banner)
	}
	out := map[string]string{}
	for _, item := range strings.Split(m[1], ", ") {
		name, u, ok := strings.Cut(item, " ")
		if !ok {
			t.Fatalf("metrics: item %q is not <service> <url>", item)
		}
		out[name] = u
	}
	return out
}

// readMetricsTargets reads make run's file_sd file: service -> address.
func readMetricsTargets(t *testing.T, runDir string) map[string]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(runDir, "metrics-targets.json"))
	if err != nil {
		t.Fatal(err)
	}
	var targets []metricsTarget
	if err := json.Unmarshal(b, &targets); err != nil {
		t.Fatalf("metrics-targets.json is not file_sd JSON: %v\n%s", err, b)
	}
	out := map[string]string{}
	for _, tg := range targets {
		if len(tg.Targets) != 1 || tg.Labels["service"] == "" {
			t.Fatalf("metrics-targets.json entry %+v; want one target and a service label", tg)
		}
		out[tg.Labels["service"]] = tg.Targets[0]
	}
	return out
}

// TestRunBannerMetrics: make run gives every service a metrics endpoint on
// a port from the kernel, prints their URLs in the banner and lists them
// in metrics-targets.json; a service whose flags set --metrics-addr keeps
// its own (here empty: no metrics); health restarted by make rebuild-views
// serves on the same address.
func TestRunBannerMetrics(t *testing.T) {
	r := startRunScript(t,
		"AGENT_FLAGS=--capacity 2",
		"GATEWAY_FLAGS=--metrics-addr=",
	)
	banner := r.waitBanner()
	urls := bannerMetricsURLs(t, banner)
	targets := readMetricsTargets(t, r.runDir)
	var names []string
	for name := range urls {
		names = append(names, name)
	}
	sort.Strings(names)
	if got := strings.Join(names, " "); got != "console health local-agent planner" {
		t.Errorf("banner's metrics services %q; want console health local-agent planner (the gateway's metrics are off)", got)
	}
	if len(targets) != len(urls) {
		t.Errorf("metrics-targets.json %v; banner %v", targets, urls)
	}
	for name, u := range urls {
		if want := "http://" + targets[name] + "/metrics"; u != want {
			t.Errorf("%s: banner %s, metrics-targets.json %s", name, u, want)
		}
		body, err := scrape(targets[name])
		if err != nil || !strings.Contains(body, "target_info") {
			t.Errorf("%s: GET %s: %v (target_info present: %v)", name, u, err, strings.Contains(body, "target_info"))
		}
	}

	// make rebuild-views restarts health on the same metrics address, so
	// the targets Prometheus has stay right.
	rebuild := exec.Command(filepath.Join("..", "scripts", "run.sh"), "rebuild-views")
	rebuild.Env = r.env
	if out, err := rebuild.CombinedOutput(); err != nil || !strings.Contains(string(out), "ok: views rebuilt") {
		t.Fatalf("run.sh rebuild-views: %v\n%s", err, out)
	}
	waitFor(t, 30*time.Second, "health serving metrics again at "+targets["health"], func() bool {
		body, err := scrape(targets["health"])
		return err == nil && strings.Contains(body, "target_info")
	})
	if after := readMetricsTargets(t, r.runDir); after["health"] != targets["health"] {
		t.Errorf("after rebuild-views metrics-targets.json has health at %s; want %s", after["health"], targets["health"])
	}
}

// getJSON GETs u and decodes its JSON body into v.
func getJSON(u string, v any) error {
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(u)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", u, resp.Status, b)
	}
	return json.Unmarshal(b, v)
}

// TestObserve is make observe next to make run: Prometheus (Debian's
// package) scrapes every service of make run and has a pool of 3 ready on
// the planner's endpoint, the alert rules of deploy/prometheus loaded;
// Jaeger v2 has the trace of the pool.apply across planner, local-agent
// and health; SIGTERM stops both. make test-observe installs prometheus,
// builds jaeger and runs it with the gate forced open.
func TestObserve(t *testing.T) {
	// Prometheus and Jaeger listen where they are told, so the test runs
	// in a network namespace of its own, where their default ports are
	// free by construction: make test-observe starts it there (unshare
	// --net) and sets PROXYFLEET_OBSERVE=netns.
	if os.Getenv("PROXYFLEET_OBSERVE") != "netns" {
		t.Skip("PROXYFLEET_OBSERVE is not netns; make test-observe runs this test in a network namespace of its own")
	}
	testgate.NeedFile(t, "/usr/bin/prometheus", "Debian's prometheus (make prometheus-install)")
	jaeger, err := filepath.Abs(filepath.Join("..", "bin", "jaeger"))
	if err != nil {
		t.Fatal(err)
	}
	testgate.NeedFile(t, jaeger, "Jaeger v2 (make jaeger)")
	testgate.NeedBinary(t, "curl", "observe.sh waits with it (apt-get install curl)")

	promAddr, jaegerAddr, otlpGRPC, otlpHTTP := "127.0.0.1:9090", "127.0.0.1:16686", "127.0.0.1:4317", "127.0.0.1:4318"
	r := startRunScript(t,
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://"+otlpHTTP,
		"PLANNER_FLAGS=--reconcile-interval 200ms",
		"HEALTH_FLAGS=--probe-interval 300ms --probe-timeout 2s",
		"AGENT_FLAGS=--capacity 5",
	)
	banner := r.waitBanner()
	if !strings.Contains(banner, "traces: OTLP to http://"+otlpHTTP) {
		t.Errorf("the banner does not say where traces go:\n%s", banner)
	}

	obs := exec.Command(filepath.Join("..", "scripts", "observe.sh"))
	obs.Env = append(os.Environ(),
		"PROXYFLEET_RUN_DIR="+r.runDir,
		"PROXYFLEET_BIN="+filepath.Dir(jaeger),
		"PROXYFLEET_PROMETHEUS_ADDR="+promAddr,
		"PROXYFLEET_JAEGER_ADDR="+jaegerAddr,
		"PROXYFLEET_OTLP_GRPC_ADDR="+otlpGRPC,
		"PROXYFLEET_OTLP_HTTP_ADDR="+otlpHTTP,
	)
	obs.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	var out testwait.Buffer
	obs.Stdout, obs.Stderr = &out, &out
	if err := obs.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- obs.Wait() }()
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = syscall.Kill(-obs.Process.Pid, syscall.SIGKILL)
			<-done
		}
		if t.Failed() {
			t.Logf("---- observe.sh output ----\n%s", out.String())
			for _, name := range []string{"prometheus", "jaeger"} {
				b, _ := os.ReadFile(filepath.Join(r.runDir, "logs", name+".log"))
				if len(b) > 4000 {
					b = b[len(b)-4000:]
				}
				t.Logf("---- %s log (tail) ----\n%s", name, b)
			}
		}
	})
	waitFor(t, 90*time.Second, "observe.sh's banner", func() bool {
		select {
		case err := <-done:
			stopped = true
			t.Fatalf("observe.sh exited: %v\n%s", err, out.String())
		default:
		}
		return strings.Contains(out.String(), "Press Ctrl-C to stop.")
	})
	if s := out.String(); !strings.Contains(s, "sends its traces here (http://"+otlpHTTP+")") || !strings.Contains(s, "Prometheus at http://"+promAddr) {
		t.Errorf("observe.sh's banner does not name Prometheus at %s and make run's traces coming here:\n%s", promAddr, s)
	}

	env := bannerLine(t, banner, ". ")
	apply := bannerLine(t, banner, `nats req fleet.api.pool.apply '{"name":"demo","provider":"local","size":3}'`)
	if o, err := r.shell(env + " && " + apply); err != nil {
		t.Fatalf("%s: %v\n%s", apply, err, o)
	}

	// Every service is a target that is up.
	waitFor(t, 60*time.Second, "Prometheus to scrape the 5 services", func() bool {
		var res struct {
			Data struct {
				ActiveTargets []struct {
					Labels map[string]string `json:"labels"`
					Health string            `json:"health"`
				} `json:"activeTargets"`
			} `json:"data"`
		}
		if getJSON("http://"+promAddr+"/api/v1/targets", &res) != nil {
			return false
		}
		up := map[string]bool{}
		for _, tg := range res.Data.ActiveTargets {
			if tg.Health == "up" {
				up[tg.Labels["job"]] = true
			}
		}
		return up["planner"] && up["health"] && up["local-agent"] && up["gateway"] && up["console"]
	})
	// The planner's report of the pool, as Prometheus stored it.
	query := func(q string) (float64, bool) {
		var res struct {
			Data struct {
				Result []struct {
					Value []any `json:"value"`
				} `json:"result"`
			} `json:"data"`
		}
		if getJSON("http://"+promAddr+"/api/v1/query?query="+url.QueryEscape(q), &res) != nil || len(res.Data.Result) != 1 {
			return 0, false
		}
		s, _ := res.Data.Result[0].Value[1].(string)
		v, err := strconv.ParseFloat(s, 64)
		return v, err == nil
	}
	waitFor(t, 90*time.Second, `proxyfleet_pool_ready_proxies{pool="demo"} 3 in Prometheus`, func() bool {
		v, ok := query(`proxyfleet_pool_ready_proxies{pool="demo",job="planner"}`)
		return ok && v == 3
	})
	waitFor(t, 30*time.Second, "the recording rules evaluated", func() bool {
		v, ok := query(`proxyfleet:pool_ready_proxies:max{pool="demo"}`)
		return ok && v == 3
	})
	var rules struct {
		Data struct {
			Groups []struct {
				Rules []struct {
					Name string `json:"name"`
					Type string `json:"type"`
				} `json:"rules"`
			} `json:"groups"`
		} `json:"data"`
	}
	if err := getJSON("http://"+promAddr+"/api/v1/rules", &rules); err != nil {
		t.Fatal(err)
	}
	alerts := map[string]bool{}
	for _, g := range rules.Data.Groups {
		for _, rule := range g.Rules {
			if rule.Type == "alerting" {
				alerts[rule.Name] = true
			}
		}
	}
	for _, a := range []string{"ProxyfleetPoolBelowSize", "ProxyfleetAgentSilent", "ProxyfleetProjectionLagging", "ProxyfleetCommandsDeadLettered"} {
		if !alerts[a] {
			t.Errorf("Prometheus has no alert %s; it has %v", a, alerts)
		}
	}

	// The pool.apply's trace in Jaeger: one trace with spans of the
	// planner, the agent and health.
	waitFor(t, 60*time.Second, "a trace across planner, local-agent and health in Jaeger", func() bool {
		var res struct {
			Data []struct {
				Processes map[string]struct {
					ServiceName string `json:"serviceName"`
				} `json:"processes"`
			} `json:"data"`
		}
		if getJSON("http://"+jaegerAddr+"/api/traces?service=proxyfleet-planner&limit=50", &res) != nil {
			return false
		}
		for _, tr := range res.Data {
			seen := map[string]bool{}
			for _, p := range tr.Processes {
				seen[p.ServiceName] = true
			}
			if seen["proxyfleet-planner"] && seen["proxyfleet-local-agent"] && seen["proxyfleet-health"] {
				return true
			}
		}
		return false
	})

	// SIGTERM (Ctrl-C's effect) stops both and exits 0.
	_ = obs.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-done:
		stopped = true
		if err != nil {
			t.Errorf("observe.sh after SIGTERM: %v", err)
		}
	case <-time.After(40 * time.Second):
		t.Fatal("observe.sh still runs 40s after SIGTERM")
	}
	if !strings.Contains(out.String(), "stopped Prometheus and Jaeger") {
		t.Errorf("observe.sh did not say it stopped:\n%s", out.String())
	}
	for _, addr := range []string{promAddr, jaegerAddr, otlpHTTP} {
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			c.Close()
			t.Errorf("%s still listens after observe.sh stopped", addr)
		}
	}
	cleanUpPool(t, r, env)
}

// cleanUpPool deletes pool demo through the banner's command, so that the
// run's cleanup finds fewer proxies to stop.
func cleanUpPool(t *testing.T, r *runScript, env string) {
	t.Helper()
	if o, err := r.shell(env + ` && nats req fleet.api.pool.delete '{"name":"demo"}'`); err != nil {
		t.Logf("pool.delete: %v\n%s", err, o)
	}
}
