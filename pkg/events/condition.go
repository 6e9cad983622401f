package events

import (
	"fmt"
	"time"
)

// PoolCondition is the event type of a pool condition's transition:
// fleet.evt.pool.<name>.condition. The planner appends one only when a
// condition's status, reason or message changes, never per reconcile round.
const PoolCondition = "condition"

// Condition types a pool reports.
const (
	// ConditionReady is True when the pool has size ready proxies.
	ConditionReady = "Ready"
	// ConditionPlaced is False when proxies the pool needs cannot be put on
	// any target, or its spread cannot be met; its reason says why.
	ConditionPlaced = "Placed"
	// ConditionProgressing is True while a scale, roll, rotation or
	// replacement is under way.
	ConditionProgressing = "Progressing"
	// ConditionCleanup is False while deletes of the pool's retired
	// proxies keep failing. A pool carries it once such a delete got
	// stuck, True again when none is.
	ConditionCleanup = "Cleanup"
)

// Condition statuses.
const (
	ConditionTrue    = "True"
	ConditionFalse   = "False"
	ConditionUnknown = "Unknown"
)

// Condition reasons. Each is one CamelCase word, stable for alerting.
const (
	// Ready
	ReasonEnoughReady    = "EnoughReady"
	ReasonNotEnoughReady = "NotEnoughReady"
	// ReasonHealthUnavailable: no health replica is alive, so nobody
	// probes the proxies; the status is Unknown.
	ReasonHealthUnavailable = "HealthUnavailable"

	// Placed
	ReasonPlaced                = "Placed"
	ReasonNoLiveTarget          = "NoLiveTarget"
	ReasonNoTargetOffersImage   = "NoTargetOffersImage"
	ReasonNoTargetOffersProfile = "NoTargetOffersProfile"
	// ReasonNoTargetMatchesLabels: no live target offering the pool's
	// image and profile carries the labels its placement requires, or a
	// value its spread weighs.
	ReasonNoTargetMatchesLabels = "NoTargetMatchesLabels"
	ReasonCapacityExhausted     = "CapacityExhausted"
	ReasonQuota                 = "Quota"
	ReasonTargetsFailing        = "TargetsFailing"
	// ReasonTargetsUnhealthy: every eligible target with room fails the
	// checks health polls (fleet-targets); the message names them and
	// their failing checks.
	ReasonTargetsUnhealthy   = "TargetsUnhealthy"
	ReasonSecretsUnavailable = "SecretsUnavailable"

	// ReasonSpreadUnmet: every proxy the pool needs has a target, but a
	// value of its spread holds fewer than its share and no live target
	// with that value can take one (none, at capacity, not offering the
	// pool's image or profile, failing); the message names the value and
	// why.
	ReasonSpreadUnmet = "SpreadUnmet"

	// Progressing
	ReasonSettled   = "Settled"
	ReasonScaling   = "Scaling"
	ReasonRolling   = "Rolling"
	ReasonRotating  = "Rotating"
	ReasonReplacing = "Replacing"

	// Cleanup
	ReasonCleanedUp = "CleanedUp"
	// ReasonDeleteStuck: the delete of a retired proxy was re-issued
	// several times and the proxy is still not deleted.
	ReasonDeleteStuck = "DeleteStuck"
)

// PoolConditionData is one condition's new value.
type PoolConditionData struct {
	Type    string `json:"type"`
	Status  string `json:"status"`
	Reason  string `json:"reason"`
	Message string `json:"message,omitempty"`
}

// Validate checks the data.
func (d *PoolConditionData) Validate() error {
	var v ValidationError
	switch d.Type {
	case ConditionReady, ConditionPlaced, ConditionProgressing, ConditionCleanup:
	default:
		v.Add("type", "must be Ready, Placed, Progressing or Cleanup", d.Type)
	}
	switch d.Status {
	case ConditionTrue, ConditionFalse, ConditionUnknown:
	default:
		v.Add("status", "must be True, False or Unknown", d.Status)
	}
	if d.Reason == "" {
		v.Add("reason", "is required", "")
	}
	return v.Err()
}

// Condition is a pool condition as views and the API show it, in the
// Kubernetes style. Since is when its status last changed.
type Condition struct {
	Type    string    `json:"type"`
	Status  string    `json:"status"`
	Reason  string    `json:"reason"`
	Message string    `json:"message,omitempty"`
	Since   time.Time `json:"since"`
}

// SetCondition folds one condition event, appended at time at, into list
// and returns the new list, ordered Ready, Placed, Progressing, Cleanup. Since moves
// only when the status changes. Both the planner and the health projection
// fold conditions with it, so their answers agree.
func SetCondition(list []Condition, d PoolConditionData, at time.Time) []Condition {
	out := make([]Condition, 0, len(list)+1)
	found := false
	for _, c := range list {
		if c.Type == d.Type {
			found = true
			since := c.Since
			if c.Status != d.Status {
				since = at
			}
			c = Condition{Type: d.Type, Status: d.Status, Reason: d.Reason, Message: d.Message, Since: since}
		}
		out = append(out, c)
	}
	if !found {
		out = append(out, Condition{Type: d.Type, Status: d.Status, Reason: d.Reason, Message: d.Message, Since: at})
	}
	order := map[string]int{ConditionReady: 0, ConditionPlaced: 1, ConditionProgressing: 2, ConditionCleanup: 3}
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && order[out[j].Type] < order[out[j-1].Type]; j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out
}

// FindCondition returns the condition of type typ in list.
func FindCondition(list []Condition, typ string) (Condition, bool) {
	for _, c := range list {
		if c.Type == typ {
			return c, true
		}
	}
	return Condition{}, false
}

// String renders a condition for logs: "Placed=False (NoLiveTarget)".
func (c Condition) String() string {
	return fmt.Sprintf("%s=%s (%s)", c.Type, c.Status, c.Reason)
}
