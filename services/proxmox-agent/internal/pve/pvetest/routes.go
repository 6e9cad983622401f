package pvetest

import (
	"fmt"
	"net/url"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// Parameter checks, after the formats of the real schema.
var (
	dnsNameRE = regexp.MustCompile(`^([a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?\.)*[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?$`)
	tagRE     = regexp.MustCompile(`^[a-zA-Z0-9_][a-zA-Z0-9_\-+.]*$`)
	storRE    = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9\-_.]*[a-zA-Z0-9]$`)
	isoVolRE  = regexp.MustCompile(`^([a-zA-Z][a-zA-Z0-9\-_.]*[a-zA-Z0-9]):iso/([^/]+\.iso)$`)
)

func intRange(lo, hi int) paramCheck {
	return func(v string) string {
		n, err := strconv.Atoi(v)
		if err != nil {
			return fmt.Sprintf("type check ('integer') failed - got '%s'", v)
		}
		if n < lo || n > hi {
			return fmt.Sprintf("value must have a minimum value of %d and a maximum of %d", lo, hi)
		}
		return ""
	}
}

func boolean(v string) string {
	switch strings.ToLower(v) {
	case "0", "1", "true", "false", "yes", "no", "on", "off":
		return ""
	}
	return fmt.Sprintf("type check ('boolean') failed - got '%s'", v)
}

func dnsName(v string) string {
	if !dnsNameRE.MatchString(v) {
		return "value does not match the regex pattern"
	}
	return ""
}

func maxLen(n int) paramCheck {
	return func(v string) string {
		if len(v) > n {
			return fmt.Sprintf("value may only be %d characters long", n)
		}
		return ""
	}
}

func storageID(v string) string {
	if !storRE.MatchString(v) {
		return fmt.Sprintf("invalid storage ID '%s'", v)
	}
	return ""
}

func tagList(v string) string {
	for _, t := range splitTags(v) {
		if !tagRE.MatchString(t) {
			return fmt.Sprintf("invalid format - invalid tag '%s'", t)
		}
	}
	return ""
}

func splitTags(v string) []string {
	return strings.FieldsFunc(v, func(r rune) bool { return r == ';' || r == ',' || r == ' ' })
}

func oneOf(vals ...string) paramCheck {
	return func(v string) string {
		for _, x := range vals {
			if v == x {
				return ""
			}
		}
		return fmt.Sprintf("value '%s' does not have a value in the enumeration '%s'", v, strings.Join(vals, ", "))
	}
}

// netCheck accepts "virtio[=MAC],bridge=<br>[,tag=<1-4094>][,firewall=0|1]".
func netCheck(v string) string {
	parts := strings.Split(v, ",")
	model := strings.SplitN(parts[0], "=", 2)[0]
	if model != "virtio" && model != "e1000" && model != "model" {
		return "invalid format - format error\nnet0.model: property is missing and it is not optional"
	}
	for _, p := range parts[1:] {
		k, val, _ := strings.Cut(p, "=")
		switch k {
		case "bridge":
			if val == "" {
				return "invalid format - bridge: value is empty"
			}
		case "tag":
			if msg := intRange(1, 4094)(val); msg != "" {
				return "invalid format - tag: " + msg
			}
		case "firewall", "link_down":
			if msg := boolean(val); msg != "" {
				return "invalid format - " + k + ": " + msg
			}
		default:
			return fmt.Sprintf("invalid format - format error\nnet0.%s: property is not defined in schema", k)
		}
	}
	return ""
}

// ideCheck accepts "<storage>:iso/<file>.iso,media=cdrom" or "none,media=cdrom".
func ideCheck(v string) string {
	vol, opts, _ := strings.Cut(v, ",")
	if vol != "none" && vol != "cdrom" && !isoVolRE.MatchString(vol) {
		return fmt.Sprintf("invalid format - unable to parse volume ID '%s'", vol)
	}
	if opts != "" && opts != "media=cdrom" {
		return "invalid format - format error"
	}
	return ""
}

var routes = []route{
	{method: "GET", path: "/version", handle: (*Server).version},
	{method: "GET", path: "/cluster/resources", params: map[string]paramCheck{"type": oneOf("vm", "storage", "node", "sdn")}, handle: (*Server).resources},
	{method: "GET", path: "/cluster/nextid", params: map[string]paramCheck{"vmid": intRange(100, 999999999)}, handle: (*Server).nextID},
	{method: "POST", path: "/nodes/{node}/qemu/{vmid}/clone", params: map[string]paramCheck{
		"newid": intRange(100, 999999999), "name": dnsName, "description": nil, "full": boolean,
		"storage": storageID, "target": dnsName, "format": oneOf("raw", "qcow2", "vmdk"),
	}, required: []string{"newid"}, handle: (*Server).clone},
	{method: "GET", path: "/nodes/{node}/qemu/{vmid}/config", params: map[string]paramCheck{"current": boolean}, handle: (*Server).getConfig},
	{method: "PUT", path: "/nodes/{node}/qemu/{vmid}/config", params: map[string]paramCheck{
		"name": dnsName, "description": maxLen(8192), "tags": tagList, "net0": netCheck, "ide2": ideCheck,
		"cores": intRange(1, 1024), "memory": intRange(16, 1<<30), "agent": boolean, "digest": maxLen(40),
		"delete": nil, "onboot": boolean,
	}, handle: (*Server).putConfig},
	{method: "POST", path: "/nodes/{node}/storage/{storage}/upload", params: map[string]paramCheck{
		"content": oneOf("iso", "vztmpl", "import"), "filename": maxLen(255),
	}, required: []string{"content", "filename"}, handle: (*Server).upload},
	{method: "DELETE", path: "/nodes/{node}/storage/{storage}/content/{volume}", params: map[string]paramCheck{"delay": intRange(1, 30)}, handle: (*Server).deleteVolume},
	{method: "POST", path: "/nodes/{node}/qemu/{vmid}/status/start", params: map[string]paramCheck{"timeout": intRange(0, 86400)}, handle: (*Server).start},
	{method: "POST", path: "/nodes/{node}/qemu/{vmid}/status/stop", params: map[string]paramCheck{"timeout": intRange(0, 86400)}, handle: (*Server).stop},
	{method: "GET", path: "/nodes/{node}/qemu/{vmid}/status/current", handle: (*Server).current},
	{method: "GET", path: "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces", handle: (*Server).agentIfaces},
	{method: "DELETE", path: "/nodes/{node}/qemu/{vmid}", params: map[string]paramCheck{
		"purge": boolean, "destroy-unreferenced-disks": boolean, "skiplock": boolean,
	}, handle: (*Server).destroy},
	{method: "GET", path: "/nodes/{node}/tasks/{upid}/status", handle: (*Server).taskStatus},
	{method: "GET", path: "/nodes/{node}/tasks/{upid}/log", params: map[string]paramCheck{"limit": intRange(0, 1<<30), "start": intRange(0, 1<<30)}, handle: (*Server).taskLog},
}

func (s *Server) version(pathArgs, url.Values) (any, *apiError) {
	return map[string]string{"version": "9.1.1", "release": "9.1", "repoid": "42b4ee4c"}, nil
}

func (s *Server) resources(_ pathArgs, q url.Values) (any, *apiError) {
	typ := q.Get("type")
	var out []map[string]any
	if typ == "" || typ == "node" {
		for _, n := range s.opts.Nodes {
			st := "online"
			if s.offline[n] {
				st = "offline"
			}
			out = append(out, map[string]any{"id": "node/" + n, "type": "node", "node": n, "status": st})
		}
	}
	if typ == "" || typ == "storage" {
		for _, n := range s.opts.Nodes {
			for _, st := range s.opts.Storages {
				var used int64
				for _, size := range s.volumes[n+"/"+st.Name] {
					used += size
				}
				status := "available"
				if s.offline[n] {
					status = "unknown"
				}
				out = append(out, map[string]any{"id": "storage/" + n + "/" + st.Name, "type": "storage", "node": n,
					"storage": st.Name, "status": status, "disk": used, "maxdisk": st.Total, "content": strings.Join(st.Content, ",")})
			}
		}
	}
	if typ == "" || typ == "vm" {
		ids := make([]int, 0, len(s.vms))
		for id := range s.vms {
			ids = append(ids, id)
		}
		sort.Ints(ids)
		for _, id := range ids {
			v := s.vms[id]
			r := map[string]any{"id": fmt.Sprintf("qemu/%d", id), "vmid": id, "node": v.node, "type": "qemu"}
			if v.conf["lock"] == "clone" {
				// A VM being cloned is only a placeholder config until the
				// task completes: no name, status unknown.
				r["status"] = "unknown"
				r["lock"] = "clone"
				out = append(out, r)
				continue
			}
			r["name"] = v.conf["name"]
			r["status"] = "stopped"
			if v.running {
				r["status"] = "running"
			}
			if s.offline[v.node] {
				// The cluster has no fresh word from an offline node: its
				// guests show as unknown, whatever they do.
				r["status"] = "unknown"
			}
			if l := v.conf["lock"]; l != "" {
				r["lock"] = l
			}
			if t := v.conf["tags"]; t != "" {
				r["tags"] = t
			}
			if v.conf["template"] == "1" {
				r["template"] = 1
			} else {
				r["template"] = 0
			}
			out = append(out, r)
		}
	}
	return out, nil
}

func (s *Server) nextID(_ pathArgs, q url.Values) (any, *apiError) {
	if v := q.Get("vmid"); v != "" {
		id, _ := strconv.Atoi(v)
		if s.vms[id] != nil {
			return nil, fail(400, "VM %d already exists", id)
		}
		return id, nil
	}
	id := 100
	for s.vms[id] != nil {
		id++
	}
	if fn := s.onNextID; fn != nil {
		s.mu.Unlock()
		fn(id)
		s.mu.Lock()
	}
	if s.opts.NextIDAsString {
		s.nextStr = !s.nextStr
		if s.nextStr {
			return strconv.Itoa(id), nil
		}
	}
	return id, nil
}

func (s *Server) clone(p pathArgs, q url.Values) (any, *apiError) {
	src, err := s.lookup(p["node"], p.vmid())
	if err != nil {
		return nil, err
	}
	newid, _ := strconv.Atoi(q.Get("newid"))
	full := q.Get("full") == "1" || q.Get("full") == "true"
	target := q.Get("target")
	if target == "" {
		target = p["node"]
	}
	if src.conf["template"] != "1" && !full {
		return nil, fail(500, "Linked clone feature is not supported for drive 'scsi0'")
	}
	if s.race {
		s.race = false
		s.vms[newid] = &vm{vmid: newid, node: target, conf: map[string]string{"name": "other-tool"}}
	}
	if s.vms[newid] != nil {
		return nil, fail(500, "unable to create VM %d: config file already exists", newid)
	}
	if st := q.Get("storage"); st != "" && s.storage(st) == nil {
		return nil, fail(500, "storage '%s' does not exist", st)
	}
	// A stopped source takes a shared lock: other clones may run beside
	// this one, anything needing the config lock exclusively times out.
	if src.exclusive {
		return nil, fail(500, "%s", lockTimeout(src.vmid))
	}
	if err := src.checkLock(); err != nil {
		return nil, err
	}
	src.shared++
	s.clones++
	nv := &vm{vmid: newid, node: target, conf: map[string]string{"lock": "clone"}}
	s.vms[newid] = nv
	name, desc := q.Get("name"), q.Get("description")
	srcConf := map[string]string{}
	for k, v := range src.conf {
		srcConf[k] = v
	}
	upid := s.startTask(p["node"], "qmclone", strconv.Itoa(src.vmid), func() (string, []string) {
		src.shared--
		for k, v := range srcConf {
			switch k {
			case "template", "name", "description":
				continue
			case "scsi0":
				v = fmt.Sprintf("local-lvm:base-%d-disk-0/vm-%d-disk-0,size=4G", src.vmid, newid)
			}
			nv.conf[k] = v
		}
		if name != "" {
			nv.conf["name"] = name
		} else {
			nv.conf["name"] = fmt.Sprintf("Copy-of-VM-%s", srcConf["name"])
		}
		if desc != "" {
			nv.conf["description"] = desc
		}
		delete(nv.conf, "lock")
		return "OK", []string{fmt.Sprintf("create linked clone of drive scsi0 (local-lvm:base-%d-disk-0)", src.vmid)}
	})
	// When the task fails, the worker removes the placeholder config and
	// releases the source, as the real one does.
	s.tasks[upid].abort = func() {
		src.shared--
		delete(s.vms, newid)
	}
	return upid, nil
}

func (s *Server) getConfig(p pathArgs, _ url.Values) (any, *apiError) {
	v, err := s.lookup(p["node"], p.vmid())
	if err != nil {
		return nil, err
	}
	out := map[string]any{}
	for k, val := range v.conf {
		out[k] = val
	}
	out["digest"] = digest(v.conf)
	if v.conf["template"] == "1" {
		out["template"] = 1
	}
	return out, nil
}

func digest(conf map[string]string) string {
	keys := make([]string, 0, len(conf))
	for k := range conf {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s: %s\n", k, conf[k])
	}
	return fmt.Sprintf("%x", sha1Sum(b.String()))
}

func (s *Server) putConfig(p pathArgs, q url.Values) (any, *apiError) {
	v, err := s.lookup(p["node"], p.vmid())
	if err != nil {
		return nil, err
	}
	if v.exclusive || v.shared > 0 {
		return nil, fail(500, "%s", lockTimeout(v.vmid))
	}
	if err := v.checkLock(); err != nil {
		return nil, err
	}
	if d := q.Get("digest"); d != "" && d != digest(v.conf) {
		return nil, fail(500, "detected modified configuration - file changed by other user? Try again.")
	}
	if ide := q.Get("ide2"); ide != "" {
		vol, _, _ := strings.Cut(ide, ",")
		if m := isoVolRE.FindStringSubmatch(vol); m != nil {
			if _, ok := s.volumes[v.node+"/"+m[1]][vol]; !ok {
				return nil, fail(500, "volume '%s' does not exist", vol)
			}
		}
	}
	for k, vals := range q {
		switch k {
		case "digest":
		case "delete":
			for _, d := range strings.Split(vals[0], ",") {
				delete(v.conf, strings.TrimSpace(d))
			}
		case "ide2":
			// Like Proxmox VE, record the size of an ISO attached as a CD-ROM.
			val := vals[0]
			vol, _, _ := strings.Cut(val, ",")
			if m := isoVolRE.FindStringSubmatch(vol); m != nil {
				val += fmt.Sprintf(",size=%dK", s.volumes[v.node+"/"+m[1]][vol]>>10)
			}
			v.conf[k] = val
		default:
			v.conf[k] = vals[0]
		}
	}
	return nil, nil
}

func (s *Server) upload(p pathArgs, q url.Values) (any, *apiError) {
	st := s.storage(p["storage"])
	if st == nil {
		return nil, fail(500, "storage '%s' does not exist", p["storage"])
	}
	content := q.Get("content")
	if !containsStr(st.Content, content) {
		return nil, fail(500, "storage '%s' does not support %s content", st.Name, content)
	}
	name := q.Get("filename")
	if content == "iso" && !strings.HasSuffix(name, ".iso") && !strings.HasSuffix(name, ".img") {
		return nil, paramErr(map[string]string{"filename": "wrong file extension"})
	}
	volid := st.Name + ":iso/" + name
	vols := s.volumes[p["node"]+"/"+st.Name]
	if _, ok := vols[volid]; ok {
		return nil, fail(500, "refusing to override existing file '%s'", name)
	}
	data := q.Get("\x00data")
	var used int64
	for _, size := range vols {
		used += size
	}
	if used+int64(len(data)) > st.Total {
		return nil, fail(500, "not enough space on storage '%s'", st.Name)
	}
	if len(data) < 0x8006 || data[0x8001:0x8006] != "CD001" {
		return s.startTask(p["node"], "imgcopy", "", func() (string, []string) {
			return "uploaded file is not an ISO 9660 image", nil
		}), nil
	}
	node := p["node"]
	return s.startTask(node, "imgcopy", "", func() (string, []string) {
		s.volumes[node+"/"+st.Name][volid] = int64(len(data))
		s.uploads[node+"/"+volid] = []byte(data)
		return "OK", []string{fmt.Sprintf("target file: /mnt/pve/%s/template/iso/%s", st.Name, name)}
	}), nil
}

func (s *Server) deleteVolume(p pathArgs, _ url.Values) (any, *apiError) {
	st := s.storage(p["storage"])
	if st == nil {
		return nil, fail(500, "storage '%s' does not exist", p["storage"])
	}
	volid := p["volume"]
	if !strings.Contains(volid, ":") {
		volid = st.Name + ":" + volid
	}
	vols := s.volumes[p["node"]+"/"+st.Name]
	if _, ok := vols[volid]; !ok {
		// Like the directory plugin: a missing file is only a warning.
		return nil, nil
	}
	for _, v := range s.vms {
		if strings.HasPrefix(v.conf["ide2"], volid+",") && v.running {
			return nil, fail(500, "volume '%s' is in use by a running VM", volid)
		}
	}
	node := p["node"]
	return s.startTask(node, "imgdel", volid, func() (string, []string) {
		delete(s.volumes[node+"/"+st.Name], volid)
		delete(s.uploads, node+"/"+volid)
		return "OK", nil
	}), nil
}

func (s *Server) start(p pathArgs, _ url.Values) (any, *apiError) {
	v, err := s.lookup(p["node"], p.vmid())
	if err != nil {
		return nil, err
	}
	if v.conf["template"] == "1" {
		return nil, fail(500, "you can't start a vm if it's a template")
	}
	if err := v.checkLock(); err != nil {
		return nil, err
	}
	if v.running {
		return nil, fail(500, "VM %d already running", v.vmid)
	}
	if err := v.lockExclusive(); err != nil {
		return nil, err
	}
	return s.abortable(v, "qmstart", func() (string, []string) {
		v.exclusive = false
		if vol, _, _ := strings.Cut(v.conf["ide2"], ","); isoVolRE.MatchString(vol) {
			m := isoVolRE.FindStringSubmatch(vol)
			if _, ok := s.volumes[v.node+"/"+m[1]][vol]; !ok {
				return fmt.Sprintf("volume '%s' does not exist", vol), nil
			}
		}
		v.running = true
		v.agentWait = s.opts.AgentPolls
		return "OK", nil
	}), nil
}

func (s *Server) stop(p pathArgs, _ url.Values) (any, *apiError) {
	v, err := s.lookup(p["node"], p.vmid())
	if err != nil {
		return nil, err
	}
	if err := v.checkLock(); err != nil {
		return nil, err
	}
	if err := v.lockExclusive(); err != nil {
		return nil, err
	}
	return s.abortable(v, "qmstop", func() (string, []string) {
		v.exclusive = false
		v.running = false
		return "OK", nil
	}), nil
}

func (s *Server) current(p pathArgs, _ url.Values) (any, *apiError) {
	v, err := s.lookup(p["node"], p.vmid())
	if err != nil {
		return nil, err
	}
	out := map[string]any{"vmid": v.vmid, "status": "stopped", "qmpstatus": "stopped", "name": v.conf["name"]}
	if v.running {
		out["status"], out["qmpstatus"] = "running", "running"
	}
	if l := v.conf["lock"]; l != "" {
		out["lock"] = l
	}
	if v.conf["agent"] == "1" {
		out["agent"] = 1
	}
	if v.conf["template"] == "1" {
		out["template"] = 1
	}
	return out, nil
}

// GuestAddress is the IPv4 address the fake guest agent reports for vmid:
// a loopback address, so a test that probes it sends nothing off the
// machine.
func GuestAddress(vmid int) string {
	return fmt.Sprintf("127.77.%d.%d", vmid/250, vmid%250+2)
}

func (s *Server) agentIfaces(p pathArgs, _ url.Values) (any, *apiError) {
	v, err := s.lookup(p["node"], p.vmid())
	if err != nil {
		return nil, err
	}
	if v.conf["agent"] != "1" && !strings.HasPrefix(v.conf["agent"], "1,") && !strings.HasPrefix(v.conf["agent"], "enabled=1") {
		return nil, fail(500, "No QEMU guest agent configured")
	}
	if !v.running {
		return nil, fail(500, "VM %d is not running", v.vmid)
	}
	if v.agentWait > 0 {
		v.agentWait--
		return nil, fail(500, "QEMU guest agent is not running")
	}
	return map[string]any{"result": []map[string]any{
		{"name": "lo", "hardware-address": "00:00:00:00:00:00", "ip-addresses": []map[string]any{
			{"ip-address-type": "ipv4", "ip-address": "127.0.0.1", "prefix": 8},
			{"ip-address-type": "ipv6", "ip-address": "::1", "prefix": 128},
		}},
		{"name": "eth0", "hardware-address": "bc:24:11:5e:00:01", "ip-addresses": []map[string]any{
			{"ip-address-type": "ipv6", "ip-address": "fe80::be24:11ff:fe5e:1", "prefix": 64},
			{"ip-address-type": "ipv4", "ip-address": GuestAddress(v.vmid), "prefix": 24},
		}},
	}}, nil
}

func (s *Server) destroy(p pathArgs, _ url.Values) (any, *apiError) {
	v, err := s.lookup(p["node"], p.vmid())
	if err != nil {
		return nil, err
	}
	if err := v.checkLock(); err != nil {
		return nil, err
	}
	if v.running {
		return nil, fail(500, "VM %d is running - destroy failed", v.vmid)
	}
	if v.conf["template"] == "1" {
		for _, o := range s.vms {
			if strings.Contains(o.conf["scsi0"], fmt.Sprintf("base-%d-disk-0/", v.vmid)) {
				return nil, fail(500, "base volume 'local-lvm:base-%d-disk-0' is still in use by linked clone", v.vmid)
			}
		}
	}
	if err := v.lockExclusive(); err != nil {
		return nil, err
	}
	return s.abortable(v, "qmdestroy", func() (string, []string) {
		delete(s.vms, v.vmid)
		return "OK", []string{fmt.Sprintf("Logical volume \"vm-%d-disk-0\" successfully removed.", v.vmid)}
	}), nil
}

func (s *Server) taskStatus(p pathArgs, _ url.Values) (any, *apiError) {
	t := s.tasks[p["upid"]]
	if t == nil || t.node != p["node"] {
		return nil, fail(500, "no such task")
	}
	out := map[string]any{"upid": t.upid, "node": t.node, "type": t.typ, "id": t.id, "status": "running",
		"pid": 1000, "pstart": 1, "starttime": 1700000000, "user": "root@pam!fleet"}
	if t.exit != "" {
		out["status"] = "stopped"
		out["exitstatus"] = t.exit
	}
	return out, nil
}

func (s *Server) taskLog(p pathArgs, q url.Values) (any, *apiError) {
	t := s.tasks[p["upid"]]
	if t == nil || t.node != p["node"] {
		return nil, fail(500, "no such task")
	}
	out := []map[string]any{}
	for i, l := range t.log {
		out = append(out, map[string]any{"n": i + 1, "t": l})
	}
	if lim, err := strconv.Atoi(q.Get("limit")); err == nil && lim > 0 && len(out) > lim {
		out = out[:lim]
	}
	return out, nil
}

// abortable starts a task that holds v's config lock; a failed task
// releases it too.
func (s *Server) abortable(v *vm, typ string, finish func() (string, []string)) string {
	upid := s.startTask(v.node, typ, strconv.Itoa(v.vmid), finish)
	s.tasks[upid].abort = func() { v.exclusive = false }
	return upid
}

func containsStr(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
