// Package libvirtfake is a stateful in-memory libvirt behind the
// [libvirt.RPC] seam, for tests only: pools with volumes, domains with
// metadata and state, and libvirt's error codes for everything missing.
// Metadata comes back without its namespace declaration, as libvirtd returns
// it.
package libvirtfake

import (
	"context"
	"fmt"
	"io"
	"regexp"
	"strings"
	"sync"

	golibvirt "github.com/digitalocean/go-libvirt"

	"proxyfleet/pkg/agent"
	"proxyfleet/services/kvm-agent/internal/libvirt"
)

// Fake is one host.
type Fake struct {
	mu      sync.Mutex
	pools   map[string]map[string][]byte // pool -> volume -> content
	domains map[string]*domain
	// Calls counts calls by RPC name.
	Calls map[string]int
	// UploadHook, when set, runs before an upload reads its source.
	UploadHook func(vol string)
	// Addresses are returned by DomainInterfaceAddresses per source; Errs
	// per source make it fail.
	Addresses map[uint32][]libvirt.DomainInterface
	AddrErrs  map[uint32]error
	lastID    int32
}

// domain is one defined domain; id is its libvirt id while it runs, -1
// while it is inactive (as libvirtd numbers them).
type domain struct {
	xml     string
	running bool
	id      int32
}

func (d *domain) ref(name string) libvirt.Domain { return libvirt.Domain{Name: name, ID: d.id} }

// New returns a host with the named running pools.
func New(pools ...string) *Fake {
	f := &Fake{pools: map[string]map[string][]byte{}, domains: map[string]*domain{}, Calls: map[string]int{},
		Addresses: map[uint32][]libvirt.DomainInterface{}, AddrErrs: map[uint32]error{}}
	for _, p := range pools {
		f.pools[p] = map[string][]byte{}
	}
	return f
}

func lerr(rpc string, code golibvirt.ErrorNumber, msg string) error {
	return libvirt.Classify(&libvirt.Error{RPC: rpc, Code: uint32(code), Message: msg})
}

func (f *Fake) call(ctx context.Context, rpc string) error {
	f.Calls[rpc]++
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return nil
}

// Volume returns a volume's content.
func (f *Fake) Volume(pool, name string) ([]byte, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, ok := f.pools[pool][name]
	return b, ok
}

// PutVolume stores a volume.
func (f *Fake) PutVolume(pool, name string, b []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.pools[pool][name] = b
}

// Volumes lists the volumes of pool.
func (f *Fake) Volumes(pool string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for k := range f.pools[pool] {
		out = append(out, k)
	}
	return out
}

// DefineRaw defines a domain from XML as another tool would.
func (f *Fake) DefineRaw(name, xml string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.domains[name] = &domain{xml: xml, id: -1}
}

// DomainXML returns the XML a domain was defined with.
func (f *Fake) DomainXML(name string) (string, bool, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	d, ok := f.domains[name]
	if !ok {
		return "", false, false
	}
	return d.xml, d.running, true
}

func (f *Fake) ConnectGetLibVersion(ctx context.Context) (uint64, error) {
	return 9000000, f.call(ctx, "virConnectGetLibVersion")
}

func (f *Fake) ConnectGetHostname(ctx context.Context) (string, error) {
	return "fakehost", f.call(ctx, "virConnectGetHostname")
}

func (f *Fake) ConnectListAllDomains(ctx context.Context) ([]libvirt.Domain, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virConnectListAllDomains"); err != nil {
		return nil, err
	}
	var out []libvirt.Domain
	for n, d := range f.domains {
		out = append(out, d.ref(n))
	}
	return out, nil
}

func (f *Fake) StoragePoolLookupByName(ctx context.Context, name string) (libvirt.StoragePool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virStoragePoolLookupByName"); err != nil {
		return libvirt.StoragePool{}, err
	}
	if _, ok := f.pools[name]; !ok {
		return libvirt.StoragePool{}, lerr("virStoragePoolLookupByName", golibvirt.ErrNoStoragePool, "Storage pool not found: no storage pool with matching name '"+name+"'")
	}
	return libvirt.StoragePool{Name: name}, nil
}

func (f *Fake) StoragePoolGetInfo(ctx context.Context, pool libvirt.StoragePool) (uint8, uint64, error) {
	return libvirt.PoolRunning, 10 << 30, f.call(ctx, "virStoragePoolGetInfo")
}

func (f *Fake) StorageVolLookupByName(ctx context.Context, pool libvirt.StoragePool, name string) (libvirt.StorageVol, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virStorageVolLookupByName"); err != nil {
		return libvirt.StorageVol{}, err
	}
	if _, ok := f.pools[pool.Name][name]; !ok {
		return libvirt.StorageVol{}, lerr("virStorageVolLookupByName", golibvirt.ErrNoStorageVol, "Storage volume not found: no storage vol with matching name '"+name+"'")
	}
	return libvirt.StorageVol{Pool: pool.Name, Name: name, Key: "/pools/" + pool.Name + "/" + name}, nil
}

var volName = regexp.MustCompile(`<name>([^<]+)</name>`)

func (f *Fake) StorageVolCreateXML(ctx context.Context, pool libvirt.StoragePool, xml string) (libvirt.StorageVol, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virStorageVolCreateXML"); err != nil {
		return libvirt.StorageVol{}, err
	}
	m := volName.FindStringSubmatch(xml)
	if m == nil {
		return libvirt.StorageVol{}, lerr("virStorageVolCreateXML", golibvirt.ErrXMLError, "missing name")
	}
	if _, ok := f.pools[pool.Name][m[1]]; ok {
		return libvirt.StorageVol{}, lerr("virStorageVolCreateXML", golibvirt.ErrStorageVolExist, "storage volume '"+m[1]+"' exists already")
	}
	f.pools[pool.Name][m[1]] = []byte{}
	return libvirt.StorageVol{Pool: pool.Name, Name: m[1], Key: "/pools/" + pool.Name + "/" + m[1]}, nil
}

func (f *Fake) StorageVolGetPath(ctx context.Context, vol libvirt.StorageVol) (string, error) {
	return "/pools/" + vol.Pool + "/" + vol.Name, f.call(ctx, "virStorageVolGetPath")
}

func (f *Fake) StorageVolDelete(ctx context.Context, vol libvirt.StorageVol) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virStorageVolDelete"); err != nil {
		return err
	}
	if _, ok := f.pools[vol.Pool][vol.Name]; !ok {
		return lerr("virStorageVolDelete", golibvirt.ErrNoStorageVol, "no such volume")
	}
	delete(f.pools[vol.Pool], vol.Name)
	return nil
}

// StorageVolUpload reads r like the real seam: a source error ends the
// stream short and is returned.
func (f *Fake) StorageVolUpload(ctx context.Context, vol libvirt.StorageVol, r io.Reader, length uint64) error {
	f.mu.Lock()
	err := f.call(ctx, "virStorageVolUpload")
	hook := f.UploadHook
	f.mu.Unlock()
	if err != nil {
		return err
	}
	if hook != nil {
		hook(vol.Name)
	}
	b, rerr := io.ReadAll(io.LimitReader(r, int64(length)))
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.pools[vol.Pool][vol.Name]; !ok {
		return lerr("virStorageVolUpload", golibvirt.ErrNoStorageVol, "no such volume")
	}
	f.pools[vol.Pool][vol.Name] = b
	if rerr != nil {
		return agent.Wrap(agent.ErrTransient, fmt.Errorf("upload %s: source: %w", vol.Name, rerr))
	}
	if uint64(len(b)) != length {
		return agent.Wrap(agent.ErrTransient, fmt.Errorf("upload %s: source ended after %d of %d bytes", vol.Name, len(b), length))
	}
	return nil
}

func (f *Fake) StorageVolDownload(ctx context.Context, vol libvirt.StorageVol, max uint64) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virStorageVolDownload"); err != nil {
		return nil, err
	}
	b, ok := f.pools[vol.Pool][vol.Name]
	if !ok {
		return nil, lerr("virStorageVolDownload", golibvirt.ErrNoStorageVol, "no such volume")
	}
	if uint64(len(b)) > max {
		b = b[:max]
	}
	return append([]byte(nil), b...), nil
}

func (f *Fake) domain(rpc, name string) (*domain, error) {
	d, ok := f.domains[name]
	if !ok {
		return nil, lerr(rpc, golibvirt.ErrNoDomain, "Domain not found: no domain with matching name '"+name+"'")
	}
	return d, nil
}

func (f *Fake) DomainLookupByName(ctx context.Context, name string) (libvirt.Domain, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virDomainLookupByName"); err != nil {
		return libvirt.Domain{}, err
	}
	d, err := f.domain("virDomainLookupByName", name)
	if err != nil {
		return libvirt.Domain{}, err
	}
	return d.ref(name), nil
}

func (f *Fake) DomainDefineXML(ctx context.Context, xml string) (libvirt.Domain, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virDomainDefineXML"); err != nil {
		return libvirt.Domain{}, err
	}
	m := volName.FindStringSubmatch(xml)
	if m == nil {
		return libvirt.Domain{}, lerr("virDomainDefineXML", golibvirt.ErrXMLError, "missing name")
	}
	d, ok := f.domains[m[1]]
	if ok {
		d.xml = xml
	} else {
		d = &domain{xml: xml, id: -1}
		f.domains[m[1]] = d
	}
	return d.ref(m[1]), nil
}

func (f *Fake) DomainCreate(ctx context.Context, dom libvirt.Domain) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virDomainCreate"); err != nil {
		return err
	}
	d, err := f.domain("virDomainCreate", dom.Name)
	if err != nil {
		return err
	}
	if d.running {
		return lerr("virDomainCreate", golibvirt.ErrOperationInvalid, "Requested operation is not valid: domain is already running")
	}
	f.lastID++
	d.running, d.id = true, f.lastID
	return nil
}

func (f *Fake) DomainGetState(ctx context.Context, dom libvirt.Domain) (int32, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virDomainGetState"); err != nil {
		return 0, err
	}
	d, err := f.domain("virDomainGetState", dom.Name)
	if err != nil {
		return 0, err
	}
	if d.running {
		return libvirt.DomainRunning, nil
	}
	return libvirt.DomainShutoff, nil
}

func (f *Fake) DomainDestroy(ctx context.Context, dom libvirt.Domain) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virDomainDestroy"); err != nil {
		return err
	}
	d, err := f.domain("virDomainDestroy", dom.Name)
	if err != nil {
		return err
	}
	if !d.running {
		return lerr("virDomainDestroy", golibvirt.ErrOperationInvalid, "Requested operation is not valid: domain is not running")
	}
	d.running, d.id = false, -1
	return nil
}

func (f *Fake) DomainUndefineFlags(ctx context.Context, dom libvirt.Domain) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virDomainUndefineFlags"); err != nil {
		return err
	}
	if _, err := f.domain("virDomainUndefineFlags", dom.Name); err != nil {
		return err
	}
	delete(f.domains, dom.Name)
	return nil
}

var nsDecl = regexp.MustCompile(`\s+xmlns:(\w+)='[^']*'`)

// DomainGetMetadata returns the element of namespace uri as libvirtd does:
// re-serialised without the namespace declaration.
func (f *Fake) DomainGetMetadata(ctx context.Context, dom libvirt.Domain, uri string) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virDomainGetMetadata"); err != nil {
		return "", err
	}
	d, err := f.domain("virDomainGetMetadata", dom.Name)
	if err != nil {
		return "", err
	}
	i := strings.Index(d.xml, "xmlns:")
	if i < 0 || !strings.Contains(d.xml, "'"+uri+"'") {
		return "", lerr("virDomainGetMetadata", golibvirt.ErrNoDomainMetadata, "metadata not found: Requested metadata element is not present")
	}
	start := strings.LastIndex(d.xml[:i], "<")
	m := nsDecl.FindStringSubmatch(d.xml[start:])
	prefix := m[1]
	end := strings.Index(d.xml, "</"+prefix+":instance>")
	el := d.xml[start : end+len("</"+prefix+":instance>")]
	el = nsDecl.ReplaceAllString(el, "")
	el = strings.ReplaceAll(el, prefix+":", "")
	return el, nil
}

func (f *Fake) DomainInterfaceAddresses(ctx context.Context, dom libvirt.Domain, source uint32) ([]libvirt.DomainInterface, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ctx, "virDomainInterfaceAddresses"); err != nil {
		return nil, err
	}
	if err := f.AddrErrs[source]; err != nil {
		return nil, err
	}
	return f.Addresses[source], nil
}

var _ libvirt.RPC = (*Fake)(nil)
