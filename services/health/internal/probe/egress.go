package probe

// egressIndex groups the probed proxies by the egress IP of their last
// successful probe and counts each group, so a probe learns how many other
// proxies share its proxy's egress in O(1), whatever the size of the group.
// Not safe for concurrent use: the [Prober] guards it with its mutex.
type egressIndex struct {
	of    map[string]string // proxy id → egress IP
	count map[string]int    // egress IP → proxies egressing from it
}

func newEgressIndex() *egressIndex {
	return &egressIndex{of: map[string]string{}, count: map[string]int{}}
}

// set records that id egresses from ip; an empty ip forgets id's egress.
func (x *egressIndex) set(id, ip string) {
	old, had := x.of[id]
	if had && old == ip {
		return
	}
	if had {
		if x.count[old] <= 1 {
			delete(x.count, old)
		} else {
			x.count[old]--
		}
		delete(x.of, id)
	}
	if ip == "" {
		return
	}
	x.of[id] = ip
	x.count[ip]++
}

// ip returns the egress IP of id, or "" when none is known.
func (x *egressIndex) ip(id string) string { return x.of[id] }

// others returns how many other proxies egress from id's egress IP.
func (x *egressIndex) others(id string) int {
	ip, ok := x.of[id]
	if !ok {
		return 0
	}
	return x.count[ip] - 1
}
