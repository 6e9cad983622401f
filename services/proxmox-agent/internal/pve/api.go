package pve

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"mime/multipart"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"proxyfleet/pkg/agent"
)

// This file mirrors the API calls the agent makes, one method per call, in
// the order of the API tree. None of them holds logic beyond encoding.

// Version is the answer of GET /version.
type Version struct {
	Version string `json:"version"`
	Release string `json:"release"`
	RepoID  string `json:"repoid"`
}

// Version returns the API version (GET /version).
func (c *Client) Version(ctx context.Context) (Version, error) {
	var v Version
	err := c.do(ctx, http.MethodGet, "/version", nil, &v)
	return v, err
}

// Resource is one item of GET /cluster/resources. A VM being cloned has no
// Name and Lock "clone".
type Resource struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Node     string `json:"node"`
	VMID     int    `json:"vmid,omitempty"`
	Name     string `json:"name,omitempty"`
	Status   string `json:"status,omitempty"`
	Lock     string `json:"lock,omitempty"`
	Tags     string `json:"tags,omitempty"`
	Template int    `json:"template,omitempty"`
	Storage  string `json:"storage,omitempty"`
	Disk     int64  `json:"disk,omitempty"`
	MaxDisk  int64  `json:"maxdisk,omitempty"`
}

// Resources lists cluster resources of one type ("vm", "storage", "node";
// empty for all) (GET /cluster/resources).
func (c *Client) Resources(ctx context.Context, typ string) ([]Resource, error) {
	var q url.Values
	if typ != "" {
		q = url.Values{"type": {typ}}
	}
	var out []Resource
	err := c.do(ctx, http.MethodGet, "/cluster/resources", q, &out)
	return out, err
}

// NextID returns a VMID that is free now (GET /cluster/nextid). It reserves
// nothing: two callers get the same answer. Some servers answer with a
// string, others with a number.
func (c *Client) NextID(ctx context.Context) (int, error) {
	var raw json.RawMessage
	if err := c.do(ctx, http.MethodGet, "/cluster/nextid", nil, &raw); err != nil {
		return 0, err
	}
	s := strings.Trim(string(raw), `"`)
	id, err := strconv.Atoi(s)
	if err != nil || id < 100 {
		return 0, agent.Wrapf(agent.ErrTransient, "GET /cluster/nextid: unexpected answer %s", raw)
	}
	return id, nil
}

// CloneOptions are the parameters of a clone besides the VMIDs.
type CloneOptions struct {
	Name        string
	Description string
	Full        bool
	// Storage is the target storage of a full clone (optional).
	Storage string
	// Target is the node the clone lands on when it differs from the
	// source's node (optional).
	Target string
}

// Clone starts cloning VM vmid on node into newid and returns the task's
// UPID (POST /nodes/{node}/qemu/{vmid}/clone).
func (c *Client) Clone(ctx context.Context, node string, vmid, newid int, o CloneOptions) (string, error) {
	q := url.Values{"newid": {strconv.Itoa(newid)}}
	if o.Name != "" {
		q.Set("name", o.Name)
	}
	if o.Description != "" {
		q.Set("description", o.Description)
	}
	if o.Full {
		q.Set("full", "1")
		if o.Storage != "" {
			q.Set("storage", o.Storage)
		}
	} else {
		q.Set("full", "0")
	}
	if o.Target != "" && o.Target != node {
		q.Set("target", o.Target)
	}
	var upid string
	err := c.do(ctx, http.MethodPost, vmPath(node, vmid)+"/clone", q, &upid)
	return upid, err
}

// VMConfig is the part of a VM configuration the agent reads.
type VMConfig struct {
	Name        string `json:"name,omitempty"`
	Description string `json:"description,omitempty"`
	Tags        string `json:"tags,omitempty"`
	Lock        string `json:"lock,omitempty"`
	Template    int    `json:"template,omitempty"`
	Net0        string `json:"net0,omitempty"`
	IDE2        string `json:"ide2,omitempty"`
	Digest      string `json:"digest,omitempty"`
}

// Config reads the configuration of VM vmid (GET /nodes/{node}/qemu/{vmid}/config).
func (c *Client) Config(ctx context.Context, node string, vmid int) (VMConfig, error) {
	var cfg VMConfig
	err := c.do(ctx, http.MethodGet, vmPath(node, vmid)+"/config", nil, &cfg)
	return cfg, err
}

// SetConfig changes the configuration of VM vmid synchronously
// (PUT /nodes/{node}/qemu/{vmid}/config).
func (c *Client) SetConfig(ctx context.Context, node string, vmid int, params url.Values) error {
	return c.do(ctx, http.MethodPut, vmPath(node, vmid)+"/config", params, nil)
}

// Upload stores data as filename of the given content type ("iso") on
// storage, and returns the task's UPID
// (POST /nodes/{node}/storage/{storage}/upload).
func (c *Client) Upload(ctx context.Context, node, storage, content, filename string, data []byte) (string, error) {
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	_ = mw.WriteField("content", content)
	fw, err := mw.CreateFormFile("filename", filename)
	if err != nil {
		return "", agent.Wrap(agent.ErrPermanent, err)
	}
	_, _ = fw.Write(data)
	if err := mw.Close(); err != nil {
		return "", agent.Wrap(agent.ErrPermanent, err)
	}
	p := "/nodes/" + url.PathEscape(node) + "/storage/" + url.PathEscape(storage) + "/upload"
	u := c.url(p)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u.String(), &buf)
	if err != nil {
		return "", agent.Wrap(agent.ErrPermanent, err)
	}
	req.Header.Set("Content-Type", mw.FormDataContentType())
	var upid string
	err = c.send(req, "POST "+p, url.Values{"content": {content}, "filename": {filename}}, &upid)
	return upid, err
}

// DeleteVolume removes volume volid (e.g. "proxy-seeds:iso/px-x.iso") from
// storage. It returns the task's UPID, or "" when the storage deleted it at
// once (DELETE /nodes/{node}/storage/{storage}/content/{volume}).
func (c *Client) DeleteVolume(ctx context.Context, node, storage, volid string) (string, error) {
	var upid string
	err := c.do(ctx, http.MethodDelete, "/nodes/"+url.PathEscape(node)+"/storage/"+url.PathEscape(storage)+
		"/content/"+url.PathEscape(volid), nil, &upid)
	return upid, err
}

// Start starts VM vmid and returns the task's UPID
// (POST /nodes/{node}/qemu/{vmid}/status/start).
func (c *Client) Start(ctx context.Context, node string, vmid int) (string, error) {
	var upid string
	err := c.do(ctx, http.MethodPost, vmPath(node, vmid)+"/status/start", url.Values{}, &upid)
	return upid, err
}

// Stop stops VM vmid at once (power off) and returns the task's UPID
// (POST /nodes/{node}/qemu/{vmid}/status/stop).
func (c *Client) Stop(ctx context.Context, node string, vmid int) (string, error) {
	var upid string
	err := c.do(ctx, http.MethodPost, vmPath(node, vmid)+"/status/stop", url.Values{}, &upid)
	return upid, err
}

// VMStatus is the answer of GET /nodes/{node}/qemu/{vmid}/status/current.
type VMStatus struct {
	Status    string `json:"status"` // running or stopped
	QMPStatus string `json:"qmpstatus,omitempty"`
	Name      string `json:"name,omitempty"`
	Lock      string `json:"lock,omitempty"`
	Template  int    `json:"template,omitempty"`
	Agent     int    `json:"agent,omitempty"`
}

// Status reads the current status of VM vmid
// (GET /nodes/{node}/qemu/{vmid}/status/current).
func (c *Client) Status(ctx context.Context, node string, vmid int) (VMStatus, error) {
	var s VMStatus
	err := c.do(ctx, http.MethodGet, vmPath(node, vmid)+"/status/current", nil, &s)
	return s, err
}

// Interface is one guest network interface reported by the guest agent.
type Interface struct {
	Name         string `json:"name"`
	HardwareAddr string `json:"hardware-address,omitempty"`
	IPAddresses  []struct {
		Type    string `json:"ip-address-type"`
		Address string `json:"ip-address"`
		Prefix  int    `json:"prefix"`
	} `json:"ip-addresses,omitempty"`
}

// NetworkInterfaces asks the guest agent of VM vmid for its interfaces
// (GET /nodes/{node}/qemu/{vmid}/agent/network-get-interfaces). It fails
// while the guest agent is not running.
func (c *Client) NetworkInterfaces(ctx context.Context, node string, vmid int) ([]Interface, error) {
	var out struct {
		Result []Interface `json:"result"`
	}
	err := c.do(ctx, http.MethodGet, vmPath(node, vmid)+"/agent/network-get-interfaces", nil, &out)
	return out.Result, err
}

// DeleteVM destroys VM vmid with purge (removing it from jobs and
// unreferenced disks) and returns the task's UPID
// (DELETE /nodes/{node}/qemu/{vmid}).
func (c *Client) DeleteVM(ctx context.Context, node string, vmid int) (string, error) {
	var upid string
	err := c.do(ctx, http.MethodDelete, vmPath(node, vmid),
		url.Values{"purge": {"1"}, "destroy-unreferenced-disks": {"1"}}, &upid)
	return upid, err
}

// TaskStatus is the answer of GET /nodes/{node}/tasks/{upid}/status.
type TaskStatus struct {
	Status     string `json:"status"` // running or stopped
	ExitStatus string `json:"exitstatus,omitempty"`
	Type       string `json:"type"`
	ID         string `json:"id"`
}

// TaskStatus reads the status of task upid
// (GET /nodes/{node}/tasks/{upid}/status).
func (c *Client) TaskStatus(ctx context.Context, node, upid string) (TaskStatus, error) {
	var s TaskStatus
	err := c.do(ctx, http.MethodGet, "/nodes/"+url.PathEscape(node)+"/tasks/"+url.PathEscape(upid)+"/status", nil, &s)
	return s, err
}

// TaskLog returns up to limit lines of the log of task upid
// (GET /nodes/{node}/tasks/{upid}/log).
func (c *Client) TaskLog(ctx context.Context, node, upid string, limit int) ([]string, error) {
	var lines []struct {
		N int    `json:"n"`
		T string `json:"t"`
	}
	err := c.do(ctx, http.MethodGet, "/nodes/"+url.PathEscape(node)+"/tasks/"+url.PathEscape(upid)+"/log",
		url.Values{"limit": {strconv.Itoa(limit)}}, &lines)
	out := make([]string, 0, len(lines))
	for _, l := range lines {
		out = append(out, l.T)
	}
	return out, err
}

// WaitTask polls task upid until it stops. A task that stopped with an exit
// status other than "OK" or "WARNINGS: n" is a classified [*TaskError]
// carrying the end of the task log. The node is taken from the UPID.
func (c *Client) WaitTask(ctx context.Context, upid string) error {
	if upid == "" {
		return nil
	}
	node, err := UPIDNode(upid)
	if err != nil {
		return agent.Wrap(agent.ErrPermanent, err)
	}
	t := time.NewTicker(c.poll)
	defer t.Stop()
	for {
		st, err := c.TaskStatus(ctx, node, upid)
		if err != nil {
			if agent.Classify(err) == agent.ClassPermanent {
				return fmt.Errorf("task %s: %w", upid, err)
			}
			// A failed poll says nothing about the task: poll again.
		} else if st.Status == "stopped" {
			if st.ExitStatus == "OK" || strings.HasPrefix(st.ExitStatus, "WARNINGS") {
				return nil
			}
			te := &TaskError{UPID: upid, Type: st.Type, ExitStatus: st.ExitStatus}
			if lines, lerr := c.TaskLog(ctx, node, upid, 50); lerr == nil {
				te.Log = lastNonEmpty(lines, 10)
			}
			return Classify(te)
		}
		select {
		case <-ctx.Done():
			return agent.Wrapf(agent.ErrTransient, "task %s still running: %w", upid, ctx.Err())
		case <-t.C:
		}
	}
}

// UPIDNode returns the node a task runs on, the second field of its UPID
// ("UPID:pve1:0000A1B2:...").
func UPIDNode(upid string) (string, error) {
	parts := strings.Split(upid, ":")
	if len(parts) < 3 || parts[0] != "UPID" || parts[1] == "" {
		return "", fmt.Errorf("malformed UPID %q", upid)
	}
	return parts[1], nil
}

func lastNonEmpty(lines []string, n int) []string {
	var out []string
	for _, l := range lines {
		if strings.TrimSpace(l) != "" && l != "TASK OK" {
			out = append(out, l)
		}
	}
	if len(out) > n {
		out = out[len(out)-n:]
	}
	return out
}

func vmPath(node string, vmid int) string {
	return "/nodes/" + url.PathEscape(node) + "/qemu/" + strconv.Itoa(vmid)
}
