package events

import (
	"cmp"
	"maps"
	"strconv"
	"strings"
	"time"
)

// ProxyView is one proxy as readers show it: the value of its key in the
// fleet-proxies view (health's projection) and the answer of
// fleet.api.proxy.get and proxy.list (the planner's fold). Both fold the
// log through [NewProxyView] and [ProxyView.Apply], so for one log they
// hold the same values. Every field comes from the event log, times
// included, so replaying the log gives the same bytes.
type ProxyView struct {
	ID       string `json:"id"`
	Pool     string `json:"pool"`
	Entry    string `json:"entry"`
	Target   string `json:"target"`
	Instance string `json:"instance"`
	// State is the proxy's lifecycle state (see [Transition]):
	// requested, provisioning, running, ready, unhealthy, failed or
	// retiring; deleted or abandoned in the planner's memory only (the view
	// drops the key).
	State string `json:"state"`
	// Address is host:port of the proxy once it ran; it is kept when a
	// running proxy reports provisioning again.
	Address    string `json:"address"`
	ProviderID string `json:"providerID,omitempty"`
	// Attempt is the create attempt the proxy is at.
	Attempt  int    `json:"attempt"`
	Revision int    `json:"revision"`
	Port     int    `json:"port,omitempty"`
	Image    string `json:"image,omitempty"`
	Profile  string `json:"profile,omitempty"`
	// Username is the basic-auth user the proxy demands, if any (the
	// password is never in the log; it lives in fleet-secrets).
	Username string `json:"username,omitempty"`
	// Replaces names the proxy this one was requested to replace.
	Replaces string `json:"replaces,omitempty"`
	// ReplacedBy names the proxy requested to replace this one, and
	// ReplaceReason why: this one is retired once that one is ready.
	ReplacedBy    string `json:"replacedBy,omitempty"`
	ReplaceReason string `json:"replaceReason,omitempty"`
	// Labels are the labels of the proxy's target (region, country,
	// provider, …) as the planner's placement decision recorded them;
	// gateway clients select proxies by them (<pool>.region-eu).
	Labels map[string]string `json:"labels,omitempty"`

	// Reason says why the proxy is unhealthy (the last probe error),
	// failed or retiring.
	Reason string `json:"reason,omitempty"`
	// FailureClass is the class of the last failure (quota, terminated, …).
	FailureClass string `json:"failureClass,omitempty"`
	// SkipCleanup means the proxy is being abandoned: its instance stays.
	SkipCleanup bool `json:"skipCleanup,omitempty"`
	// Streak is the failure streak reported by the last unhealthy event.
	Streak int `json:"streak,omitempty"`
	// UnhealthySince is when the proxy turned unhealthy (the time of the
	// health service's event); zero unless it is unhealthy.
	UnhealthySince time.Time `json:"unhealthySince,omitzero"`
	// DisabledUntil is when a disabled (external) proxy may return to
	// service, on its next good probe; zero unless it is disabled.
	DisabledUntil time.Time `json:"disabledUntil,omitzero"`
	// LatencyMS and EgressIP are those of the last ready event.
	LatencyMS int64  `json:"latencyMs,omitempty"`
	EgressIP  string `json:"egressIP,omitempty"`

	CreatedAt time.Time `json:"createdAt"`
	UpdatedAt time.Time `json:"updatedAt"`
	// Seq is the FLEET_EVENTS sequence of the last event applied.
	Seq uint64 `json:"seq"`
}

// NewProxyView is the view the first requested event of proxy id (event
// envId, stored at seq at time at) creates.
func NewProxyView(id, envID string, seq uint64, at time.Time, d ProxyRequestedData) ProxyView {
	at = at.UTC()
	return ProxyView{
		ID: id, Pool: d.Pool, Entry: d.Entry, Target: d.Target, Instance: d.Instance,
		Revision: d.Revision, Port: d.Port, Image: d.Image, Profile: d.Profile,
		Username: d.Username, Replaces: d.Replaces, Labels: maps.Clone(d.Labels), Attempt: AttemptOf(envID, id, ProxyRequested),
		State: ProxyRequested, CreatedAt: at, UpdatedAt: at, Seq: seq,
	}
}

// Apply records one event of the proxy that [Transition] applies: kind
// moves the proxy from v.State to to (which may be v.State itself). The
// event is e, stored at seq. It returns the error of data that does not
// decode, changing nothing; [CheckProxyData] refuses such events first.
func (v *ProxyView) Apply(to string, seq uint64, kind string, e Envelope) error {
	prev := *v
	switch kind {
	case ProxyRequested:
		// A re-issued create: the next attempt of the same decision.
		var d ProxyRequestedData
		if err := e.DecodeData(&d); err != nil {
			return err
		}
		v.Attempt = AttemptOf(e.ID, v.ID, ProxyRequested)
	case ProxyProvisioning:
		var d ProxyProvisioningData
		if err := e.DecodeData(&d); err != nil {
			return err
		}
		// Entry and target stay those of the requested event: placing
		// is the planner's decision, and [CheckPlacement] kept other
		// agents' observations out.
		v.Instance = cmp.Or(d.Instance, v.Instance)
		v.ProviderID = cmp.Or(d.ProviderID, v.ProviderID)
		if d.Attempt > 0 {
			v.Attempt = d.Attempt
		}
		v.Reason, v.FailureClass, v.Streak = "", "", 0
	case ProxyRunning:
		var d ProxyRunningData
		if err := e.DecodeData(&d); err != nil {
			return err
		}
		v.Address = d.Address
		v.ProviderID = cmp.Or(d.ProviderID, v.ProviderID)
		if d.Attempt > 0 {
			v.Attempt = d.Attempt
		}
		v.Reason, v.FailureClass, v.Streak = "", "", 0
	case ProxyReady:
		var d ProxyReadyData
		if err := e.DecodeData(&d); err != nil {
			return err
		}
		v.Address = cmp.Or(d.Address, v.Address)
		v.LatencyMS, v.EgressIP = d.LatencyMS, d.EgressIP
		v.Reason, v.FailureClass, v.Streak = "", "", 0
	case ProxyUnhealthy:
		var d ProxyUnhealthyData
		if err := e.DecodeData(&d); err != nil {
			return err
		}
		v.Reason, v.FailureClass, v.Streak = d.Reason, "", d.Streak
	case ProxyFailed:
		var d ProxyFailedData
		if err := e.DecodeData(&d); err != nil {
			return err
		}
		v.Reason, v.FailureClass, v.Streak = d.Reason, d.Class, 0
		if d.Attempt > 0 {
			v.Attempt = d.Attempt
		}
	case ProxyRetiring:
		var d ProxyRetiringData
		if err := e.DecodeData(&d); err != nil {
			return err
		}
		v.Reason, v.Streak = d.Reason, 0
		v.SkipCleanup = v.SkipCleanup || d.SkipCleanup
	case ProxyDisabled:
		var d ProxyDisabledData
		if err := e.DecodeData(&d); err != nil {
			return err
		}
		v.Reason, v.FailureClass, v.Streak = d.Reason, "", 0
		v.DisabledUntil = d.Until.UTC()
	case ProxyDeleted, ProxyAbandoned:
	}
	if to != ProxyDisabled {
		v.DisabledUntil = time.Time{}
	}
	if to != kind {
		// A create finishing after the planner decided to fail or retire
		// the proxy: what the agent saw is recorded (the delete needs the
		// provider id), but the proxy keeps its state and the reason for
		// it.
		v.Reason, v.FailureClass = prev.Reason, prev.FailureClass
	}
	switch {
	case to != ProxyUnhealthy:
		v.UnhealthySince = time.Time{}
	case prev.State != ProxyUnhealthy:
		v.UnhealthySince = e.Time.UTC()
	}
	v.State, v.UpdatedAt, v.Seq = to, e.Time.UTC(), seq
	return nil
}

// NoteReplacement records on the view that proxy by was requested to
// replace it, for why.
func (v *ProxyView) NoteReplacement(by, why string) {
	v.ReplacedBy, v.ReplaceReason = by, why
}

// Probeable reports whether the proxy should be probed: it has an address
// and is running, ready, unhealthy or disabled (a disabled proxy returns
// to service on a good probe once its time has passed).
func (v ProxyView) Probeable() bool {
	if v.Address == "" {
		return false
	}
	switch v.State {
	case ProxyRunning, ProxyReady, ProxyUnhealthy, ProxyDisabled:
		return true
	}
	return false
}

// AttemptOf reads n from an event id "<proxy>.<type>.<n>[.<suffix>]" (see
// [ProxyEventID]); 1 when the id has another shape.
func AttemptOf(envID, proxyID, typ string) int {
	rest, ok := strings.CutPrefix(envID, proxyID+"."+typ+".")
	if !ok {
		return 1
	}
	if i := strings.IndexByte(rest, '.'); i >= 0 {
		rest = rest[:i]
	}
	n, err := strconv.Atoi(rest)
	if err != nil || n < 1 {
		return 1
	}
	return n
}
