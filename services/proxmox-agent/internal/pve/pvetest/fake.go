// Package pvetest is a stateful fake of the Proxmox VE API for tests only;
// no product code imports it. It serves the endpoints the proxmox-agent
// uses over TLS and enforces what a real Proxmox VE does: per-VMID config
// locks (a shared lock on a stopped clone source), tasks that stay running
// for several requests and report their outcome only in their exit status,
// /cluster/nextid that reserves nothing (and sometimes answers a string), a
// clone that shows in /cluster/resources with no name and "lock: clone"
// until it completes, parameter validation with a 400 "errors" map, errors
// whose HTTP reason phrase is the message's first line on a connection that
// is then closed, and "501 no such uri" for unknown paths.
package pvetest

import (
	"crypto/sha1"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// Options shape a [Server]. Zero values take the defaults noted.
type Options struct {
	// Token is the API token the server accepts
	// (default "root@pam!fleet=secret").
	Token string
	// Nodes of the cluster (default ["pve1"]).
	Nodes []string
	// Storages on every node (default "local-lvm" for images and
	// "proxy-seeds" for iso, 100 GiB each).
	Storages []Storage
	// TaskTicks is how many requests a task stays running for (default 3).
	// Every request to the server advances every running task by one tick.
	TaskTicks int
	// AgentPolls is how many guest-agent requests fail with "QEMU guest
	// agent is not running" after a VM starts (default 2).
	AgentPolls int
	// NextIDAsString makes every other /cluster/nextid answer a string.
	NextIDAsString bool
}

// Storage is one storage on every node.
type Storage struct {
	Name    string
	Content []string // "images", "iso", ...
	Total   int64
}

// Call is one request the server received: its method, the route it matched
// (a schema path such as /nodes/{node}/qemu/{vmid}/clone) and the names of
// its parameters.
type Call struct {
	Method string
	Route  string
	Params []string
}

// Server is a running fake. Its methods are safe for concurrent use.
type Server struct {
	*httptest.Server
	opts Options

	mu       sync.Mutex
	vms      map[int]*vm
	volumes  map[string]map[string]int64 // node/storage → volid → size
	uploads  map[string][]byte           // node/volid → the bytes an upload stored
	tasks    map[string]*task
	offline  map[string]bool
	seq      int
	nextStr  bool
	calls    []Call
	inject   []injected
	clones   int
	onNextID func(id int)
	race     bool
}

func sha1Sum(s string) [20]byte { return sha1.Sum([]byte(s)) }

type vm struct {
	vmid    int
	node    string
	conf    map[string]string
	running bool
	// agentWait counts guest-agent requests still to fail after start.
	agentWait int
	// flock models /var/lock/qemu-server/lock-<vmid>.conf.
	shared    int
	exclusive bool
}

type task struct {
	upid   string
	node   string
	typ    string
	id     string
	ticks  int
	exit   string
	log    []string
	finish func() (exit string, log []string)
	// abort undoes what the request did when the task fails instead.
	abort    func()
	failWith string
}

type injected struct {
	method, route string
	status        int
	message       string
	task          bool // fail the task's exit status instead of the request
}

// Start runs a fake with opts and stops it at the end of the test.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	if opts.Token == "" {
		opts.Token = "root@pam!fleet=secret"
	}
	if len(opts.Nodes) == 0 {
		opts.Nodes = []string{"pve1"}
	}
	if len(opts.Storages) == 0 {
		opts.Storages = []Storage{
			{Name: "local-lvm", Content: []string{"images", "rootdir"}, Total: 100 << 30},
			{Name: "proxy-seeds", Content: []string{"iso"}, Total: 100 << 30},
		}
	}
	if opts.TaskTicks <= 0 {
		opts.TaskTicks = 3
	}
	if opts.AgentPolls <= 0 {
		opts.AgentPolls = 2
	}
	s := &Server{
		opts:    opts,
		vms:     map[int]*vm{},
		volumes: map[string]map[string]int64{},
		uploads: map[string][]byte{},
		tasks:   map[string]*task{},
		offline: map[string]bool{},
	}
	for _, n := range opts.Nodes {
		for _, st := range opts.Storages {
			s.volumes[n+"/"+st.Name] = map[string]int64{}
		}
	}
	s.Server = httptest.NewUnstartedServer(http.HandlerFunc(s.serve))
	s.Server.StartTLS()
	t.Cleanup(s.Server.Close)
	return s
}

// Token returns the API token the server accepts.
func (s *Server) Token() string { return s.opts.Token }

// Fingerprint returns the SHA-256 of the server's certificate.
func (s *Server) Fingerprint() []byte {
	sum := sha256.Sum256(s.Certificate().Raw)
	return sum[:]
}

// AddTemplate adds a stopped template VM on node.
func (s *Server) AddTemplate(node string, vmid int, name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.vms[vmid] = &vm{vmid: vmid, node: node, conf: map[string]string{
		"name": name, "template": "1", "agent": "1", "cores": "1", "memory": "1024",
		"scsi0": fmt.Sprintf("local-lvm:base-%d-disk-0,size=4G", vmid), "net0": "virtio=BC:24:11:00:00:01,bridge=vmbr0,firewall=1",
	}}
}

// AddVM adds a stopped VM that proxyfleet did not make.
func (s *Server) AddVM(node string, vmid int, name string, conf map[string]string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := map[string]string{"name": name}
	for k, v := range conf {
		c[k] = v
	}
	s.vms[vmid] = &vm{vmid: vmid, node: node, conf: c}
}

// SetNodeOnline marks node online or offline in /cluster/resources.
func (s *Server) SetNodeOnline(node string, online bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.offline[node] = !online
}

// OnNextID installs fn, called (without the server's lock) after each
// /cluster/nextid answer with the id answered, so a test can let another
// client take that id.
func (s *Server) OnNextID(fn func(id int)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.onNextID = fn
}

// RaceNextClone makes another client take the new VMID of the next clone
// request just before it is handled, as a second tool racing on the same
// /cluster/nextid answer would: the clone then fails with "config file
// already exists" and the other VM ("other-tool") stays.
func (s *Server) RaceNextClone() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.race = true
}

// FailNext makes the next request matching method and route (a schema path
// such as /nodes/{node}/qemu/{vmid}/status/start) fail at once with status
// and message.
func (s *Server) FailNext(method, route string, status int, message string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inject = append(s.inject, injected{method: method, route: route, status: status, message: message})
}

// FailNextTask makes the task started by the next request matching method
// and route end with exit status exit (the request itself succeeds).
func (s *Server) FailNextTask(method, route, exit string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inject = append(s.inject, injected{method: method, route: route, message: exit, task: true})
}

// VMInfo is a snapshot of one VM.
type VMInfo struct {
	VMID    int
	Node    string
	Running bool
	Conf    map[string]string
}

// VMs returns a snapshot of every VM that is not a template, by VMID.
func (s *Server) VMs() []VMInfo {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []VMInfo
	for _, v := range s.vms {
		if v.conf["template"] == "1" {
			continue
		}
		c := map[string]string{}
		for k, val := range v.conf {
			c[k] = val
		}
		out = append(out, VMInfo{VMID: v.vmid, Node: v.node, Running: v.running, Conf: c})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].VMID < out[j].VMID })
	return out
}

// Volumes returns the volume ids on storage of node.
func (s *Server) Volumes(node, storage string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for v := range s.volumes[node+"/"+storage] {
		out = append(out, v)
	}
	sort.Strings(out)
	return out
}

// Upload returns the bytes an upload stored as volid (e.g.
// "local:iso/seed.iso") on node, and whether that volume exists.
func (s *Server) Upload(node, volid string) ([]byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.uploads[node+"/"+volid]
	return b, ok
}

// Clones returns how many clone requests were accepted.
func (s *Server) Clones() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.clones
}

// RunningTasks returns how many tasks have not finished.
func (s *Server) RunningTasks() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, t := range s.tasks {
		if t.exit == "" {
			n++
		}
	}
	return n
}

// Calls returns every request received so far.
func (s *Server) Calls() []Call {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.calls)
}

// apiError is an error answer: status and message (whose first line is
// the reason phrase), and per-parameter errors for a 400.
type apiError struct {
	status  int
	message string
	errors  map[string]string
}

func fail(status int, format string, args ...any) *apiError {
	return &apiError{status: status, message: fmt.Sprintf(format, args...) + "\n"}
}

func paramErr(errs map[string]string) *apiError {
	return &apiError{status: 400, message: "Parameter verification failed.\n", errors: errs}
}

// writeError answers like pveproxy: the reason phrase is the message's first
// line, the body carries data null, the message and the errors, and the
// connection is closed.
func writeError(w http.ResponseWriter, e *apiError) {
	body := map[string]any{"data": nil, "message": e.message}
	if e.errors != nil {
		body["errors"] = e.errors
	}
	b, _ := json.Marshal(body)
	reason := strings.SplitN(e.message, "\n", 2)[0]
	hj, ok := w.(http.Hijacker)
	if !ok {
		w.Header().Set("Connection", "close")
		w.WriteHeader(e.status)
		_, _ = w.Write(b)
		return
	}
	conn, buf, err := hj.Hijack()
	if err != nil {
		return
	}
	defer conn.Close()
	fmt.Fprintf(buf, "HTTP/1.1 %d %s\r\nContent-Type: application/json;charset=UTF-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n", e.status, reason, len(b))
	_, _ = buf.Write(b)
	_ = buf.Flush()
}

func writeData(w http.ResponseWriter, data any) {
	w.Header().Set("Content-Type", "application/json;charset=UTF-8")
	b, _ := json.Marshal(map[string]any{"data": data})
	_, _ = w.Write(b)
}

// route is one endpoint of the fake: its schema path, method, the
// parameters it accepts, and its handler.
type route struct {
	method   string
	path     string
	params   map[string]paramCheck
	required []string
	handle   func(s *Server, p pathArgs, q url.Values) (any, *apiError)
}

type paramCheck func(v string) string // returns a problem, or ""

type pathArgs map[string]string

func (p pathArgs) vmid() int { n, _ := strconv.Atoi(p["vmid"]); return n }

// Route describes an endpoint the fake serves, for contract tests.
type Route struct {
	Method string
	Path   string
	Params []string
}

// Routes lists every endpoint the fake serves with the parameters it
// accepts (path parameters included).
func Routes() []Route {
	var out []Route
	for _, r := range routes {
		params := pathParams(r.path)
		for k := range r.params {
			params = append(params, k)
		}
		sort.Strings(params)
		out = append(out, Route{Method: r.method, Path: r.path, Params: params})
	}
	return out
}

var pathParamRE = regexp.MustCompile(`\{([a-z]+)\}`)

func pathParams(p string) []string {
	var out []string
	for _, m := range pathParamRE.FindAllStringSubmatch(p, -1) {
		out = append(out, m[1])
	}
	return out
}

// match finds the route of method and an escaped request path.
func match(method, escPath string) (*route, pathArgs, bool) {
	segs := strings.Split(strings.Trim(escPath, "/"), "/")
	pathKnown := false
	for i := range routes {
		r := &routes[i]
		rs := strings.Split(strings.Trim(r.path, "/"), "/")
		if len(rs) != len(segs) {
			continue
		}
		args := pathArgs{}
		ok := true
		for j, seg := range rs {
			if strings.HasPrefix(seg, "{") {
				v, err := url.PathUnescape(segs[j])
				if err != nil || v == "" {
					ok = false
					break
				}
				args[seg[1:len(seg)-1]] = v
			} else if seg != segs[j] {
				ok = false
				break
			}
		}
		if !ok {
			continue
		}
		pathKnown = true
		if r.method == method {
			return r, args, true
		}
	}
	return nil, nil, pathKnown
}

func (s *Server) serve(w http.ResponseWriter, r *http.Request) {
	const prefix = "/api2/json"
	esc := r.URL.EscapedPath()
	if !strings.HasPrefix(esc, prefix+"/") {
		writeError(w, fail(501, "no such uri"))
		return
	}
	rt, args, known := match(r.Method, strings.TrimPrefix(esc, prefix))
	if rt == nil {
		if known {
			writeError(w, fail(501, "Method '%s %s' not implemented", r.Method, strings.TrimPrefix(esc, prefix)))
			return
		}
		writeError(w, fail(501, "no such uri"))
		return
	}
	if r.Header.Get("Authorization") != "PVEAPIToken="+s.opts.Token {
		writeError(w, fail(401, "authentication failure"))
		return
	}
	q, upload, perr := readParams(r)
	if perr != nil {
		writeError(w, perr)
		return
	}
	names := make([]string, 0, len(q))
	for k := range q {
		names = append(names, k)
	}
	sort.Strings(names)

	s.mu.Lock()
	s.calls = append(s.calls, Call{Method: r.Method, Route: rt.path, Params: names})
	s.tick()
	var inj *injected
	for i, in := range s.inject {
		if in.method == r.Method && in.route == rt.path {
			inj = &s.inject[i]
			s.inject = append(s.inject[:i:i], s.inject[i+1:]...)
			break
		}
	}
	s.mu.Unlock()

	if errs := validate(rt, q); errs != nil {
		writeError(w, paramErr(errs))
		return
	}
	if inj != nil && !inj.task {
		writeError(w, &apiError{status: inj.status, message: inj.message + "\n"})
		return
	}
	if upload != nil {
		q.Set("\x00data", string(upload))
	}
	s.mu.Lock()
	if n := args["node"]; n != "" && !slices.Contains(s.opts.Nodes, n) {
		s.mu.Unlock()
		writeError(w, fail(500, "hostname lookup '%s' failed - failed to get address info for: %s: Name or service not known", args["node"], args["node"]))
		return
	}
	data, aerr := rt.handle(s, args, q)
	if inj != nil && inj.task {
		if upid, ok := data.(string); ok {
			if t := s.tasks[upid]; t != nil {
				t.failWith = inj.message
			}
		}
	}
	s.mu.Unlock()
	if aerr != nil {
		writeError(w, aerr)
		return
	}
	writeData(w, data)
}

// readParams reads query, form or multipart parameters; an upload's file
// content is returned separately.
func readParams(r *http.Request) (url.Values, []byte, *apiError) {
	switch {
	case r.Method == http.MethodGet || r.Method == http.MethodDelete:
		return r.URL.Query(), nil, nil
	case strings.HasPrefix(r.Header.Get("Content-Type"), "multipart/form-data"):
		if err := r.ParseMultipartForm(64 << 20); err != nil {
			return nil, nil, fail(400, "malformed upload: %v", err)
		}
		q := url.Values{}
		for k, v := range r.MultipartForm.Value {
			q[k] = v
		}
		var data []byte
		if fhs := r.MultipartForm.File["filename"]; len(fhs) == 1 {
			f, err := fhs[0].Open()
			if err == nil {
				data, _ = io.ReadAll(f)
				f.Close()
			}
			q.Set("filename", fhs[0].Filename)
		}
		return q, data, nil
	default:
		if err := r.ParseForm(); err != nil {
			return nil, nil, fail(400, "malformed form: %v", err)
		}
		return r.PostForm, nil, nil
	}
}

func validate(rt *route, q url.Values) map[string]string {
	errs := map[string]string{}
	for k, vals := range q {
		check, ok := rt.params[k]
		if !ok {
			errs[k] = "property is not defined in schema and the schema does not allow additional properties"
			continue
		}
		if check != nil {
			if msg := check(vals[0]); msg != "" {
				errs[k] = msg
			}
		}
	}
	for _, k := range rt.required {
		if q.Get(k) == "" {
			errs[k] = "property is missing and it is not optional"
		}
	}
	if len(errs) == 0 {
		return nil
	}
	return errs
}

// tick advances every running task by one request; a task whose ticks ran
// out finishes and applies its effect.
func (s *Server) tick() {
	for _, t := range s.tasks {
		if t.exit != "" {
			continue
		}
		t.ticks--
		if t.ticks > 0 {
			continue
		}
		exit, log := "OK", []string(nil)
		switch {
		case t.failWith != "":
			exit, log = t.failWith, []string{t.failWith}
			if t.abort != nil {
				t.abort()
			}
		case t.finish != nil:
			exit, log = t.finish()
			if exit != "OK" && t.abort != nil {
				t.abort()
			}
		}
		t.exit = exit
		t.log = append(t.log, log...)
		if exit == "OK" {
			t.log = append(t.log, "TASK OK")
		} else {
			t.log = append(t.log, "TASK ERROR: "+exit)
		}
	}
}

// startTask registers a task; finish runs when it completes and returns
// its exit status ("OK" or an error text) and log lines.
func (s *Server) startTask(node, typ, id string, finish func() (string, []string)) string {
	s.seq++
	upid := fmt.Sprintf("UPID:%s:%08X:%08X:%08X:%s:%s:root@pam!fleet:", node, 1000+s.seq, s.seq*7, 1700000000+s.seq, typ, id)
	s.tasks[upid] = &task{upid: upid, node: node, typ: typ, id: id, ticks: s.opts.TaskTicks, finish: finish}
	return upid
}

func lockTimeout(vmid int) string {
	return fmt.Sprintf("can't lock file '/var/lock/qemu-server/lock-%d.conf' - got timeout", vmid)
}

// lockExclusive takes the config lock of v for the length of a task, as a
// real worker holding lock_config would; it fails like a lock that timed out.
func (v *vm) lockExclusive() *apiError {
	if v.exclusive || v.shared > 0 {
		return fail(500, "%s", lockTimeout(v.vmid))
	}
	v.exclusive = true
	return nil
}

// checkLock refuses a change to a VM carrying a lock property.
func (v *vm) checkLock() *apiError {
	if l := v.conf["lock"]; l != "" {
		return fail(500, "VM is locked (%s)", l)
	}
	return nil
}

func (s *Server) lookup(node string, vmid int) (*vm, *apiError) {
	v := s.vms[vmid]
	if v == nil || v.node != node {
		return nil, fail(500, "Configuration file 'nodes/%s/qemu-server/%d.conf' does not exist", node, vmid)
	}
	return v, nil
}

func (s *Server) storage(name string) *Storage {
	for i := range s.opts.Storages {
		if s.opts.Storages[i].Name == name {
			return &s.opts.Storages[i]
		}
	}
	return nil
}
