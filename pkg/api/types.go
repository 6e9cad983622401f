package api

import (
	"proxyfleet/pkg/events"
	"proxyfleet/pkg/page"
)

// Nouns and verbs of the API's subjects, fleet.api.<noun>.<verb> (see
// [events.APISubject]).
const (
	NounPool     = "pool"
	NounProxy    = "proxy"
	NounInstance = "instance"

	VerbApply     = "apply"
	VerbGet       = "get"
	VerbList      = "list"
	VerbDelete    = "delete"
	VerbRecycle   = "recycle"
	VerbReportBan = "report-ban"
)

// Requests of the API besides pool.apply, whose body is an
// [events.PoolSpec].
type (
	// NameRequest selects a pool: pool.get, pool.delete.
	NameRequest struct {
		Name string `json:"name"`
	}
	// ProxyRequest selects a proxy: proxy.get.
	ProxyRequest struct {
		ID string `json:"id"`
	}
	// ProxyDeleteRequest is the body of proxy.delete.
	ProxyDeleteRequest struct {
		ID string `json:"id"`
		// SkipCleanup leaves the instance in place: the proxy is retired and
		// abandoned without a delete command.
		SkipCleanup bool `json:"skipCleanup,omitempty"`
	}
	// ProxyRecycleRequest is the body of proxy.recycle. The proxy is
	// replaced surge first (the replacement is ready before it is
	// retired) unless Now, which retires it at once.
	ProxyRecycleRequest struct {
		ID  string `json:"id"`
		Now bool   `json:"now,omitempty"`
	}
	// ProxyBanRequest is the body of proxy.report-ban: the proxy's egress
	// is banned by a site; Reason says by what or where (optional, at
	// most [MaxBanReason] bytes).
	ProxyBanRequest struct {
		ID     string `json:"id"`
		Reason string `json:"reason,omitempty"`
	}
	// ProxyListRequest is the body of proxy.list: one page of the live
	// proxies in id order, of one pool when Pool is set.
	ProxyListRequest struct {
		Pool string `json:"pool,omitempty"`
		PageRequest
	}
	// PoolListRequest is the body of pool.list: one page of the pools in
	// name order.
	PoolListRequest struct {
		PageRequest
	}
	// InstanceDeleteRequest is the body of instance.delete: one instance on
	// one target of an entry, by its backend name ("px-…").
	InstanceDeleteRequest struct {
		Entry  string `json:"entry"`
		Target string `json:"target"`
		Name   string `json:"name"`
	}
)

// PageRequest is the paging part of a list request (see package [page]):
// Limit, and After, the Next of the previous page.
type PageRequest = page.Request

// MaxBanReason bounds the Reason of a [ProxyBanRequest], in bytes.
const MaxBanReason = 160

// Replies of the API. pool.apply, pool.get and pool.delete answer a
// [PoolView]; proxy.get, proxy.delete, proxy.recycle and proxy.report-ban
// answer the proxy's [events.ProxyView].
type (
	// PoolList is the reply of pool.list.
	PoolList struct {
		Pools []PoolView `json:"pools"`
		// Next is the After of the next page; "" on the last page.
		Next string `json:"next"`
	}
	// ProxyList is the reply of proxy.list.
	ProxyList struct {
		Proxies []events.ProxyView `json:"proxies"`
		// Next is the After of the next page; "" on the last page.
		Next string `json:"next"`
	}
	// InstanceDeleteReply is the answer of instance.delete: the delete
	// command sent for the instance. The agent records the outcome on the
	// proxy's subject (deleted, or failed with the reason).
	InstanceDeleteReply struct {
		Entry   string `json:"entry"`
		Target  string `json:"target"`
		Name    string `json:"name"`
		ProxyID string `json:"proxyID"`
		Pool    string `json:"pool,omitempty"`
		Attempt int    `json:"attempt"`
		// Previous is what the planner knew of the proxy: abandoned,
		// deleted or unknown.
		Previous string `json:"previous"`
	}
)

// PoolView is the API's answer about one pool.
type PoolView struct {
	Name     string          `json:"name"`
	Spec     events.PoolSpec `json:"spec"`
	Revision int             `json:"revision"`
	Deleted  bool            `json:"deleted"`
	// ShapeRevision is the revision at which the instance-shaping part of
	// the spec last changed.
	ShapeRevision int `json:"shapeRevision"`
	// Size is the number of proxies the pool wants: Spec.Size, or for an
	// autoscaled pool the size autoscaling set last.
	Size int `json:"size"`
	// ScaleReason is why autoscaling set Size ("autoscale: 37 connections
	// for 10 proxies"); "" until it scaled the pool.
	ScaleReason string `json:"scaleReason,omitempty"`
	// Active counts the proxies that count toward Size.
	Active int `json:"active"`
	// Outdated counts the active proxies requested before ShapeRevision:
	// they are being rolled.
	Outdated int `json:"outdated"`
	// States counts the pool's live proxies per state: deleted and
	// abandoned ones are not counted.
	States map[string]int `json:"states"`
	// Conditions say whether the pool is ready, whether its proxies can be
	// placed and whether a change is under way, and why.
	Conditions []events.Condition `json:"conditions"`
}
