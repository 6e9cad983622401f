// Package libvirt is the kvm-agent's only door to libvirtd: the [RPC] seam
// (one method per libvirt function the agent calls, context first), the
// [Host] that runs those calls over one shared go-libvirt connection per
// host with a budget per call, the dialers (local unix socket, SSH), the
// [Traced] decorator that gives every call one span and one log line, and
// [Classify], which maps libvirt error codes onto the agent's error classes.
package libvirt

import (
	"context"
	"io"

	golibvirt "github.com/digitalocean/go-libvirt"
)

// Types of the libvirt wire protocol used through the seam.
type (
	Domain          = golibvirt.Domain
	StoragePool     = golibvirt.StoragePool
	StorageVol      = golibvirt.StorageVol
	DomainInterface = golibvirt.DomainInterface
)

// Address sources of virDomainInterfaceAddresses.
const (
	SourceLease = uint32(golibvirt.DomainInterfaceAddressesSrcLease)
	SourceAgent = uint32(golibvirt.DomainInterfaceAddressesSrcAgent)
	SourceARP   = uint32(golibvirt.DomainInterfaceAddressesSrcArp)
)

// Domain and pool states.
const (
	DomainRunning     = int32(golibvirt.DomainRunning)
	DomainBlocked     = int32(golibvirt.DomainBlocked)
	DomainPaused      = int32(golibvirt.DomainPaused)
	DomainShutdown    = int32(golibvirt.DomainShutdown)
	DomainShutoff     = int32(golibvirt.DomainShutoff)
	DomainCrashed     = int32(golibvirt.DomainCrashed)
	DomainPmsuspended = int32(golibvirt.DomainPmsuspended)
	PoolRunning       = uint8(golibvirt.StoragePoolRunning)
)

// RPC mirrors the libvirt functions the agent calls, and nothing else. Each
// method is one libvirt RPC named after the libvirt function (without its
// "vir" prefix), takes ctx first and returns when ctx ends. Errors keep the
// libvirt code so [Classify] can read it.
type RPC interface {
	ConnectGetLibVersion(ctx context.Context) (uint64, error)
	ConnectGetHostname(ctx context.Context) (string, error)
	ConnectListAllDomains(ctx context.Context) ([]Domain, error)

	StoragePoolLookupByName(ctx context.Context, name string) (StoragePool, error)
	// StoragePoolGetInfo returns the pool state and its available bytes.
	StoragePoolGetInfo(ctx context.Context, pool StoragePool) (state uint8, available uint64, err error)

	StorageVolLookupByName(ctx context.Context, pool StoragePool, name string) (StorageVol, error)
	StorageVolCreateXML(ctx context.Context, pool StoragePool, xml string) (StorageVol, error)
	StorageVolGetPath(ctx context.Context, vol StorageVol) (string, error)
	StorageVolDelete(ctx context.Context, vol StorageVol) error
	// StorageVolUpload streams length bytes of r into vol from offset 0, on
	// a connection of its own that is closed before it returns. An error
	// from r ends the stream as a short upload and is returned.
	StorageVolUpload(ctx context.Context, vol StorageVol, r io.Reader, length uint64) error
	// StorageVolDownload reads at most max bytes of vol.
	StorageVolDownload(ctx context.Context, vol StorageVol, max uint64) ([]byte, error)

	DomainLookupByName(ctx context.Context, name string) (Domain, error)
	DomainDefineXML(ctx context.Context, xml string) (Domain, error)
	DomainCreate(ctx context.Context, dom Domain) error
	DomainGetState(ctx context.Context, dom Domain) (int32, error)
	DomainDestroy(ctx context.Context, dom Domain) error
	// DomainUndefineFlags undefines dom and removes its NVRAM file.
	DomainUndefineFlags(ctx context.Context, dom Domain) error
	// DomainGetMetadata returns the metadata element of namespace uri, as
	// libvirt returns it (without the namespace declaration).
	DomainGetMetadata(ctx context.Context, dom Domain, uri string) (string, error)
	DomainInterfaceAddresses(ctx context.Context, dom Domain, source uint32) ([]DomainInterface, error)
}
