package gce

import (
	"cmp"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/api/compute/v1"
)

// fakeCompute is a stateful stand-in for the Compute Engine API, holding
// instances and zone operations and enforcing the semantics this backend
// relies on: operations advance from RUNNING to DONE over polls, wait may
// answer a RUNNING operation, a repeated requestId answers the first
// operation, names are unique per zone, errors have the API's JSON shape,
// aggregatedList pages and filters by labels.
type fakeCompute struct {
	t       testing.TB
	srv     *httptest.Server
	project string

	mu          sync.Mutex
	zones       []string
	unreachable map[string]bool
	instances   map[string]map[string]*compute.Instance // zone → name
	ops         map[string]*fakeOp
	requestIDs  map[string]string // requestId → operation name
	nextID      uint64
	pollsToDone int  // wait calls before an operation is DONE
	getsToRun   int  // GETs before a new instance is RUNNING with an address
	pageSize    int  // default aggregatedList page size
	waitEarly   bool // the first wait of every operation answers RUNNING
	getCounts   map[string]int
	syncErrs    map[string][]fakeErr // "METHOD kind" → queued errors
	opErrs      map[string][]string  // zone → queued operation error codes for inserts
	requests    []fakeRequest
	authSeen    []string
	inserts     int
}

type fakeErr struct {
	code   int
	reason string
	msg    string
}

type fakeRequest struct {
	Method, Path string
	Query        []string
	Status       int
	Body         []byte
	Kind         string // schema name of a 2xx response
}

type fakeOp struct {
	op      *compute.Operation
	polls   int
	errCode string
	apply   func()
}

func newFakeCompute(t testing.TB, zones ...string) *fakeCompute {
	f := &fakeCompute{
		t: t, project: "proj-1", zones: zones, unreachable: map[string]bool{},
		instances: map[string]map[string]*compute.Instance{}, ops: map[string]*fakeOp{},
		requestIDs: map[string]string{}, pollsToDone: 2, getsToRun: 2, pageSize: 500, waitEarly: true,
		getCounts: map[string]int{}, syncErrs: map[string][]fakeErr{}, opErrs: map[string][]string{},
	}
	for _, z := range zones {
		f.instances[z] = map[string]*compute.Instance{}
	}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeCompute) base() string { return f.srv.URL + "/compute/v1/" }

var (
	reInsertList = regexp.MustCompile(`^projects/([^/]+)/zones/([^/]+)/instances$`)
	reInstance   = regexp.MustCompile(`^projects/([^/]+)/zones/([^/]+)/instances/([^/]+)$`)
	reAggregated = regexp.MustCompile(`^projects/([^/]+)/aggregated/instances$`)
	reWait       = regexp.MustCompile(`^projects/([^/]+)/zones/([^/]+)/operations/([^/]+)/wait$`)
	reStop       = regexp.MustCompile(`^projects/([^/]+)/zones/([^/]+)/instances/([^/]+)/stop$`)
	reName       = regexp.MustCompile(`^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$`)
	reLabelKey   = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,62}$`)
	reLabelValue = regexp.MustCompile(`^[a-z0-9_-]{0,63}$`)
	reUUID       = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)
	reFilter     = regexp.MustCompile(`^labels\.([a-z][a-z0-9_-]*) = "([a-z0-9_-]*)"$`)
)

// fakeRoutes are the discovery method ids the fake serves, by method and
// path template; the contract test checks them against the discovery doc.
var fakeRoutes = map[string][2]string{
	"compute.instances.insert":         {"POST", "projects/{project}/zones/{zone}/instances"},
	"compute.instances.list":           {"GET", "projects/{project}/zones/{zone}/instances"},
	"compute.instances.get":            {"GET", "projects/{project}/zones/{zone}/instances/{instance}"},
	"compute.instances.delete":         {"DELETE", "projects/{project}/zones/{zone}/instances/{instance}"},
	"compute.instances.aggregatedList": {"GET", "projects/{project}/aggregated/instances"},
	"compute.zoneOperations.wait":      {"POST", "projects/{project}/zones/{zone}/operations/{operation}/wait"},
	// Not called by the driver: an operator (or a host event) stopping an
	// instance behind the agent's back.
	"compute.instances.stop": {"POST", "projects/{project}/zones/{zone}/instances/{instance}/stop"},
}

type recorder struct {
	http.ResponseWriter
	status int
	body   []byte
}

func (r *recorder) WriteHeader(c int) { r.status = c; r.ResponseWriter.WriteHeader(c) }
func (r *recorder) Write(b []byte) (int, error) {
	r.body = append(r.body, b...)
	return r.ResponseWriter.Write(b)
}

func (f *fakeCompute) serve(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if r.URL.Path == "/token" {
		f.serveToken(w, r)
		return
	}
	f.authSeen = append(f.authSeen, r.Header.Get("Authorization"))
	rec := &recorder{ResponseWriter: w, status: 200}
	path := strings.TrimPrefix(r.URL.Path, "/compute/v1/")
	kind := f.route(rec, r, path)
	var q []string
	for k := range r.URL.Query() {
		q = append(q, k)
	}
	sort.Strings(q)
	req := fakeRequest{Method: r.Method, Path: path, Query: q, Status: rec.status, Body: rec.body}
	if rec.status < 300 {
		req.Kind = kind
	}
	f.requests = append(f.requests, req)
}

// serveToken is an OAuth 2.0 token endpoint for service-account JWT grants.
func (f *fakeCompute) serveToken(w http.ResponseWriter, r *http.Request) {
	_ = r.ParseForm()
	if r.Form.Get("grant_type") != "urn:ietf:params:oauth:grant-type:jwt-bearer" || r.Form.Get("assertion") == "" {
		http.Error(w, `{"error":"invalid_grant"}`, http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"access_token":%q,"token_type":"Bearer","expires_in":3600}`, fakeAccessToken)
}

// fakeAccessToken is what the token endpoint issues; tests look for it in logs.
var fakeAccessToken = "ya29.canary-access-token-" + strconv.FormatInt(time.Now().UnixNano(), 36)

func (f *fakeCompute) route(w http.ResponseWriter, r *http.Request, path string) string {
	var m []string
	key := func(kind string) string { return r.Method + " " + kind }
	pop := func(kind string) bool {
		list := f.syncErrs[key(kind)]
		if len(list) == 0 {
			return false
		}
		e := list[0]
		f.syncErrs[key(kind)] = list[1:]
		f.apiError(w, e.code, e.reason, e.msg)
		return true
	}
	project := func() bool {
		if m[1] != f.project {
			f.apiError(w, 404, "notFound", fmt.Sprintf("The resource 'projects/%s' was not found", m[1]))
			return false
		}
		return true
	}
	zone := func(z string) bool {
		if _, ok := f.instances[z]; !ok {
			f.apiError(w, 400, "invalid", fmt.Sprintf("Invalid value for field 'zone': '%s'. Unknown zone.", z))
			return false
		}
		if f.unreachable[z] {
			f.apiError(w, 503, "backendError", "Internal error. Please try again or contact Google Support.")
			return false
		}
		return true
	}
	switch {
	case r.Method == "POST" && reInsertList.MatchString(path):
		m = reInsertList.FindStringSubmatch(path)
		if !project() || !zone(m[2]) || pop("insert") {
			return ""
		}
		return f.insert(w, r, m[2])
	case r.Method == "GET" && reInsertList.MatchString(path):
		m = reInsertList.FindStringSubmatch(path)
		if !project() || !zone(m[2]) || pop("list") {
			return ""
		}
		return f.list(w, r, m[2])
	case r.Method == "GET" && reInstance.MatchString(path):
		m = reInstance.FindStringSubmatch(path)
		if !project() || !zone(m[2]) || pop("get") {
			return ""
		}
		return f.get(w, m[2], m[3])
	case r.Method == "DELETE" && reInstance.MatchString(path):
		m = reInstance.FindStringSubmatch(path)
		if !project() || !zone(m[2]) || pop("delete") {
			return ""
		}
		return f.delete(w, r, m[2], m[3])
	case r.Method == "GET" && reAggregated.MatchString(path):
		m = reAggregated.FindStringSubmatch(path)
		if !project() || pop("aggregatedList") {
			return ""
		}
		return f.aggregated(w, r)
	case r.Method == "POST" && reStop.MatchString(path):
		m = reStop.FindStringSubmatch(path)
		if !project() || !zone(m[2]) || pop("stop") {
			return ""
		}
		return f.stop(w, r, m[2], m[3])
	case r.Method == "POST" && reWait.MatchString(path):
		m = reWait.FindStringSubmatch(path)
		if !project() || !zone(m[2]) || pop("wait") {
			return ""
		}
		return f.wait(w, m[2], m[3])
	}
	f.apiError(w, 404, "notFound", "The requested URL /compute/v1/"+path+" was not found on this server.")
	return ""
}

func (f *fakeCompute) apiError(w http.ResponseWriter, code int, reason, msg string) {
	body := map[string]any{"error": map[string]any{
		"code": code, "message": msg,
		"errors": []map[string]string{{"domain": "global", "reason": reason, "message": msg}},
	}}
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(body)
}

func (f *fakeCompute) reply(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	_ = json.NewEncoder(w).Encode(v)
}

func (f *fakeCompute) link(parts ...string) string { return f.base() + strings.Join(parts, "/") }

func (f *fakeCompute) newOp(zone, typ, target, requestID string, apply func()) *fakeOp {
	f.nextID++
	name := fmt.Sprintf("operation-%d-%d", time.Now().UnixNano(), f.nextID)
	o := &fakeOp{op: &compute.Operation{
		Kind: "compute#operation", Id: f.nextID, Name: name, OperationType: typ, Status: "RUNNING", Progress: 0,
		Zone: f.link("projects", f.project, "zones", zone), TargetLink: target,
		SelfLink:   f.link("projects", f.project, "zones", zone, "operations", name),
		InsertTime: time.Now().UTC().Format(time.RFC3339), User: "agent@proj-1.iam.gserviceaccount.com",
	}, apply: apply}
	f.ops[name] = o
	if requestID != "" {
		f.requestIDs[requestID] = name
	}
	return o
}

func (f *fakeCompute) insert(w http.ResponseWriter, r *http.Request, zone string) string {
	rid := r.URL.Query().Get("requestId")
	if rid != "" && !reUUID.MatchString(rid) {
		f.apiError(w, 400, "invalid", fmt.Sprintf("Invalid value for field 'requestId': '%s'. The request ID must be a valid UUID with the exception that zero UUID is not supported (00000000-0000-0000-0000-000000000000).", rid))
		return ""
	}
	if name, ok := f.requestIDs[rid]; ok && rid != "" {
		f.reply(w, f.ops[name].op)
		return "Operation"
	}
	var in compute.Instance
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
		f.apiError(w, 400, "parseError", "Parse Error")
		return ""
	}
	if msg := validateInsert(&in, zone); msg != "" {
		f.apiError(w, 400, "invalid", msg)
		return ""
	}
	if _, exists := f.instances[zone][in.Name]; exists {
		f.apiError(w, 409, "alreadyExists", fmt.Sprintf("The resource 'projects/%s/zones/%s/instances/%s' already exists", f.project, zone, in.Name))
		return ""
	}
	f.inserts++
	f.nextID++
	inst := in
	inst.Kind, inst.Id, inst.Status = "compute#instance", f.nextID, "PROVISIONING"
	inst.Zone = f.link("projects", f.project, "zones", zone)
	inst.SelfLink = f.link("projects", f.project, "zones", zone, "instances", in.Name)
	inst.MachineType = f.link("projects", f.project, inst.MachineType)
	inst.CreationTimestamp = time.Now().UTC().Format(time.RFC3339)
	// The instance is visible while the insert runs, as on the real API.
	f.instances[zone][in.Name] = &inst
	op := f.newOp(zone, "insert", inst.SelfLink, rid, nil)
	op.op.TargetId = inst.Id
	if codes := f.opErrs[zone]; len(codes) > 0 {
		op.errCode = codes[0]
		f.opErrs[zone] = codes[1:]
		op.apply = func() { delete(f.instances[zone], in.Name) }
	}
	f.reply(w, op.op)
	return "Operation"
}

func validateInsert(in *compute.Instance, zone string) string {
	switch {
	case !reName.MatchString(in.Name):
		return fmt.Sprintf("Invalid value for field 'resource.name': '%s'. Must be a match of regex '(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?)'", in.Name)
	case !strings.HasPrefix(in.MachineType, "zones/"+zone+"/machineTypes/"):
		return fmt.Sprintf("Invalid value for field 'resource.machineType': '%s'. Machine type with name '%s' does not exist in zone '%s'.", in.MachineType, lastSegment(in.MachineType), zone)
	case len(in.Disks) == 0 || !in.Disks[0].Boot || in.Disks[0].InitializeParams == nil || in.Disks[0].InitializeParams.SourceImage == "":
		return "Invalid value for field 'resource.disks': ''. Boot disk must be specified."
	case len(in.NetworkInterfaces) == 0:
		return "Invalid value for field 'resource.networkInterfaces': ''. At least one network interface is required."
	}
	for k, v := range in.Labels {
		if !reLabelKey.MatchString(k) || !reLabelValue.MatchString(v) {
			return fmt.Sprintf("Invalid value for field 'resource.labels': ''. Label key '%s' or value '%s' violates format constraints.", k, v)
		}
	}
	size := 0
	if in.Metadata != nil {
		for _, it := range in.Metadata.Items {
			if it.Value != nil {
				size += len(it.Key) + len(*it.Value)
			}
		}
	}
	if size > 512*1024 {
		return "Invalid value for field 'resource.metadata': ''. Metadata total size exceeds 512 KB."
	}
	return ""
}

func (f *fakeCompute) get(w http.ResponseWriter, zone, name string) string {
	inst, ok := f.instances[zone][name]
	if !ok {
		f.apiError(w, 404, "notFound", fmt.Sprintf("The resource 'projects/%s/zones/%s/instances/%s' was not found", f.project, zone, name))
		return ""
	}
	k := zone + "/" + name
	f.getCounts[k]++
	if inst.Status == "PROVISIONING" || inst.Status == "STAGING" {
		if f.getCounts[k] >= f.getsToRun && f.opDone(inst.SelfLink) {
			f.start(inst)
		} else if f.getCounts[k] >= 1 {
			inst.Status = "STAGING"
		}
	}
	f.reply(w, inst)
	return "Instance"
}

// opDone reports whether no operation on target is still running.
func (f *fakeCompute) opDone(target string) bool {
	for _, o := range f.ops {
		if o.op.TargetLink == target && o.op.Status != "DONE" {
			return false
		}
	}
	return true
}

func (f *fakeCompute) start(inst *compute.Instance) {
	inst.Status = "RUNNING"
	nic := inst.NetworkInterfaces[0]
	nic.NetworkIP = fmt.Sprintf("10.128.0.%d", inst.Id%250+2)
	nic.Network = cmp.Or(nic.Network, f.link("projects", f.project, "global/networks/default"))
	for _, ac := range nic.AccessConfigs {
		ac.NatIP = fmt.Sprintf("203.0.113.%d", inst.Id%250+2)
		ac.Kind = "compute#accessConfig"
	}
}

func (f *fakeCompute) delete(w http.ResponseWriter, r *http.Request, zone, name string) string {
	rid := r.URL.Query().Get("requestId")
	if rid != "" && !reUUID.MatchString(rid) {
		f.apiError(w, 400, "invalid", "Invalid value for field 'requestId'")
		return ""
	}
	if opName, ok := f.requestIDs[rid]; ok && rid != "" {
		f.reply(w, f.ops[opName].op)
		return "Operation"
	}
	inst, ok := f.instances[zone][name]
	if !ok {
		f.apiError(w, 404, "notFound", fmt.Sprintf("The resource 'projects/%s/zones/%s/instances/%s' was not found", f.project, zone, name))
		return ""
	}
	inst.Status = "STOPPING"
	op := f.newOp(zone, "delete", inst.SelfLink, rid, func() { delete(f.instances[zone], name) })
	op.op.TargetId = inst.Id
	f.reply(w, op.op)
	return "Operation"
}

// stop powers an instance off as the API does: STOPPING while its
// operation runs, then TERMINATED, keeping its disks and internal address
// and releasing an ephemeral external one. Stopping a TERMINATED instance
// succeeds without change.
func (f *fakeCompute) stop(w http.ResponseWriter, r *http.Request, zone, name string) string {
	rid := r.URL.Query().Get("requestId")
	if opName, ok := f.requestIDs[rid]; ok && rid != "" {
		f.reply(w, f.ops[opName].op)
		return "Operation"
	}
	inst, ok := f.instances[zone][name]
	if !ok {
		f.apiError(w, 404, "notFound", fmt.Sprintf("The resource 'projects/%s/zones/%s/instances/%s' was not found", f.project, zone, name))
		return ""
	}
	if inst.Status != "TERMINATED" {
		inst.Status = "STOPPING"
	}
	op := f.newOp(zone, "stop", inst.SelfLink, rid, func() {
		inst.Status = "TERMINATED"
		for _, nic := range inst.NetworkInterfaces {
			for _, ac := range nic.AccessConfigs {
				ac.NatIP = ""
			}
		}
	})
	op.op.TargetId = inst.Id
	f.reply(w, op.op)
	return "Operation"
}

func (f *fakeCompute) wait(w http.ResponseWriter, zone, name string) string {
	o, ok := f.ops[name]
	if !ok || !strings.HasSuffix(o.op.Zone, "/zones/"+zone) {
		f.apiError(w, 404, "notFound", fmt.Sprintf("The resource 'projects/%s/zones/%s/operations/%s' was not found", f.project, zone, name))
		return ""
	}
	if o.op.Status != "DONE" {
		o.polls++
		if o.polls >= f.pollsToDone && !(f.waitEarly && o.polls == 1) {
			f.finish(o)
		} else {
			o.op.Progress = int64(o.polls * 100 / (f.pollsToDone + 1))
		}
	}
	f.reply(w, o.op)
	return "Operation"
}

func (f *fakeCompute) finish(o *fakeOp) {
	o.op.Status, o.op.Progress, o.op.EndTime = "DONE", 100, time.Now().UTC().Format(time.RFC3339)
	if o.apply != nil {
		o.apply()
	}
	switch o.errCode {
	case "":
	case codeQuotaExceeded:
		o.op.HttpErrorStatusCode, o.op.HttpErrorMessage = 403, "FORBIDDEN"
		o.op.Error = &compute.OperationError{Errors: []*compute.OperationErrorErrors{{Code: o.errCode,
			Message: "Quota 'CPUS' exceeded.  Limit: 8.0 in region us-central1."}}}
	default:
		o.op.HttpErrorStatusCode, o.op.HttpErrorMessage = 503, "SERVICE UNAVAILABLE"
		o.op.Error = &compute.OperationError{Errors: []*compute.OperationErrorErrors{{Code: o.errCode,
			Message: "The zone '" + o.op.Zone + "' does not have enough resources available to fulfill the request.  Try a different zone, or try again later."}}}
	}
}

// matchFilter applies a "labels.<key> = \"<value>\"" filter, the only form
// this backend sends; anything else is refused as the API refuses a
// malformed filter.
func matchFilter(filter string, inst *compute.Instance) (bool, bool) {
	if filter == "" {
		return true, true
	}
	m := reFilter.FindStringSubmatch(filter)
	if m == nil {
		return false, false
	}
	return inst.Labels[m[1]] == m[2], true
}

func (f *fakeCompute) list(w http.ResponseWriter, r *http.Request, zone string) string {
	q := r.URL.Query()
	max := 500
	if s := q.Get("maxResults"); s != "" {
		max, _ = strconv.Atoi(s)
	}
	var items []*compute.Instance
	for _, name := range sortedNames(f.instances[zone]) {
		inst := f.instances[zone][name]
		ok, valid := matchFilter(q.Get("filter"), inst)
		if !valid {
			f.apiError(w, 400, "invalid", "Invalid value for field 'filter': '"+q.Get("filter")+"'. Invalid list filter expression.")
			return ""
		}
		if ok {
			items = append(items, inst)
		}
	}
	out := &compute.InstanceList{Kind: "compute#instanceList", Id: "projects/" + f.project + "/zones/" + zone + "/instances",
		SelfLink: f.link("projects", f.project, "zones", zone, "instances")}
	if len(items) > max {
		items, out.NextPageToken = items[:max], "next"
	}
	out.Items = items
	f.reply(w, out)
	return "InstanceList"
}

func (f *fakeCompute) aggregated(w http.ResponseWriter, r *http.Request) string {
	q := r.URL.Query()
	size := f.pageSize
	if s := q.Get("maxResults"); s != "" {
		size, _ = strconv.Atoi(s)
	}
	type hit struct {
		zone string
		inst *compute.Instance
	}
	var hits []hit
	zones := append([]string(nil), f.zones...)
	sort.Strings(zones)
	for _, z := range zones {
		if f.unreachable[z] {
			continue
		}
		for _, name := range sortedNames(f.instances[z]) {
			ok, valid := matchFilter(q.Get("filter"), f.instances[z][name])
			if !valid {
				f.apiError(w, 400, "invalid", "Invalid value for field 'filter': '"+q.Get("filter")+"'. Invalid list filter expression.")
				return ""
			}
			if ok {
				hits = append(hits, hit{z, f.instances[z][name]})
			}
		}
	}
	start := 0
	if tok := q.Get("pageToken"); tok != "" {
		n, err := strconv.Atoi(strings.TrimPrefix(tok, "page-"))
		if err != nil || n > len(hits) {
			f.apiError(w, 400, "invalid", "Invalid value for field 'pageToken': '"+tok+"'.")
			return ""
		}
		start = n
	}
	end := min(start+size, len(hits))
	out := &compute.InstanceAggregatedList{Kind: "compute#instanceAggregatedList", Id: "projects/" + f.project + "/aggregated/instances",
		SelfLink: f.link("projects", f.project, "aggregated/instances"), Items: map[string]compute.InstancesScopedList{}}
	for _, z := range zones {
		var sl compute.InstancesScopedList
		for _, h := range hits[start:end] {
			if h.zone == z {
				sl.Instances = append(sl.Instances, h.inst)
			}
		}
		switch {
		case f.unreachable[z]:
			sl.Warning = &compute.InstancesScopedListWarning{Code: "UNREACHABLE",
				Message: "Scope 'zones/" + z + "' is unreachable.",
				Data:    []*compute.InstancesScopedListWarningData{{Key: "scope", Value: "zones/" + z}}}
		case len(sl.Instances) == 0:
			sl.Warning = &compute.InstancesScopedListWarning{Code: "NO_RESULTS_ON_PAGE",
				Message: "There are no results for scope 'zones/" + z + "' on this page.",
				Data:    []*compute.InstancesScopedListWarningData{{Key: "scope", Value: "zones/" + z}}}
		}
		out.Items["zones/"+z] = sl
	}
	if end < len(hits) {
		out.NextPageToken = "page-" + strconv.Itoa(end)
	}
	f.reply(w, out)
	return "InstanceAggregatedList"
}

func sortedNames(m map[string]*compute.Instance) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Test helpers, all under the fake's lock.

func (f *fakeCompute) failNext(method, kind string, code int, reason, msg string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.syncErrs[method+" "+kind] = append(f.syncErrs[method+" "+kind], fakeErr{code, reason, msg})
}

func (f *fakeCompute) failInsertOp(zone, code string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.opErrs[zone] = append(f.opErrs[zone], code)
}

func (f *fakeCompute) put(zone string, inst *compute.Instance) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nextID++
	inst.Id, inst.Kind = f.nextID, "compute#instance"
	inst.Zone = f.link("projects", f.project, "zones", zone)
	inst.SelfLink = f.link("projects", f.project, "zones", zone, "instances", inst.Name)
	f.instances[zone][inst.Name] = inst
}

func (f *fakeCompute) instance(zone, name string) *compute.Instance {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.instances[zone][name]
}

func (f *fakeCompute) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, z := range f.instances {
		n += len(z)
	}
	return n
}

func (f *fakeCompute) setUnreachable(zone string, v bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.unreachable[zone] = v
}

func (f *fakeCompute) recorded() []fakeRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]fakeRequest(nil), f.requests...)
}
