package probe

// Owner is the member that probes proxy id among the sorted members.
var Owner = owner

// Members returns the replica's current view of the members (nil when it
// probes every proxy or is no member).
func (p *Prober) Members() []string {
	if p.shard == nil {
		return nil
	}
	return p.shard.list()
}

// KeepMembershipOnExit makes Run end without deleting the replica's key, as
// a replica killed with SIGKILL would: the others take over when it expires.
func (p *Prober) KeepMembershipOnExit() { p.stay = true }
