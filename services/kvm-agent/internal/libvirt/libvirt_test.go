package libvirt

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"

	golibvirt "github.com/digitalocean/go-libvirt"

	"proxyfleet/pkg/agent"
)

func TestClassify(t *testing.T) {
	le := func(code golibvirt.ErrorNumber) error { return &Error{RPC: "virX", Code: uint32(code), Message: "m"} }
	tests := []struct {
		name string
		err  error
		want string
	}{
		{"no domain", le(golibvirt.ErrNoDomain), agent.ClassNotFound},
		{"no volume", le(golibvirt.ErrNoStorageVol), agent.ClassNotFound},
		{"no metadata", le(golibvirt.ErrNoDomainMetadata), agent.ClassNotFound},
		{"no pool", le(golibvirt.ErrNoStoragePool), agent.ClassPermanent},
		{"no network", le(golibvirt.ErrNoNetwork), agent.ClassPermanent},
		{"xml error", le(golibvirt.ErrXMLError), agent.ClassPermanent},
		{"invalid arg", le(golibvirt.ErrInvalidArg), agent.ClassPermanent},
		{"access denied", le(golibvirt.ErrAccessDenied), agent.ClassPermanent},
		{"no support", le(golibvirt.ErrNoSupport), agent.ClassPermanent},
		{"config unsupported", le(golibvirt.ErrConfigUnsupported), agent.ClassPermanent},
		{"operation unsupported", le(golibvirt.ErrOperationUnsupported), agent.ClassPermanent},
		{"auth failed", le(golibvirt.ErrAuthFailed), agent.ClassPermanent},
		{"operation timeout", le(golibvirt.ErrOperationTimeout), agent.ClassTransient},
		{"agent unresponsive", le(golibvirt.ErrAgentUnresponsive), agent.ClassTransient},
		{"resource busy", le(golibvirt.ErrResourceBusy), agent.ClassTransient},
		{"operation invalid", le(golibvirt.ErrOperationInvalid), agent.ClassTransient},
		{"system error", le(golibvirt.ErrSystemError), agent.ClassTransient},
		{"rpc", le(golibvirt.ErrRPC), agent.ClassTransient},
		{"internal", le(golibvirt.ErrInternalError), agent.ClassTransient},
		{"domain exists", le(golibvirt.ErrDomExist), agent.ClassTransient},
		{"volume exists", le(golibvirt.ErrStorageVolExist), agent.ClassTransient},
		{"unknown code", le(golibvirt.ErrorNumber(9999)), agent.ClassTransient},
		{"transport", io.ErrUnexpectedEOF, agent.ClassTransient},
		{"already classified wins", agent.Wrap(agent.ErrTransient, le(golibvirt.ErrInvalidArg)), agent.ClassTransient},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := Classify(tc.err)
			if c := agent.Classify(got); c != tc.want {
				t.Errorf("class = %q, want %q (err %v)", c, tc.want, got)
			}
			if !errors.Is(got, tc.err) {
				t.Errorf("classified error lost its cause")
			}
			if got.Error() != tc.err.Error() {
				t.Errorf("message = %q, want %q", got.Error(), tc.err.Error())
			}
		})
	}
	if Classify(nil) != nil {
		t.Error("Classify(nil) != nil")
	}
}

func TestFromLibvirt(t *testing.T) {
	err := fromLibvirt("virDomainCreate", golibvirt.Error{Code: uint32(golibvirt.ErrNoDomain), Message: "Domain not found"})
	if !IsNotFound(err) || !HasCode(err, golibvirt.ErrNoDomain) {
		t.Fatalf("fromLibvirt lost the code: %v", err)
	}
	if want := "virDomainCreate: Domain not found (libvirt ErrNoDomain, code 42)"; err.Error() != want {
		t.Errorf("message = %q, want %q", err.Error(), want)
	}
	plain := errors.New("broken pipe")
	if got := fromLibvirt("virX", plain); got != plain {
		t.Errorf("transport error changed: %v", got)
	}
}

type failingReader struct {
	data []byte
	err  error
}

func (f *failingReader) Read(p []byte) (int, error) {
	if len(f.data) == 0 {
		return 0, f.err
	}
	n := copy(p, f.data)
	f.data = f.data[n:]
	return n, nil
}

func TestEOFReaderKeepsTheError(t *testing.T) {
	boom := errors.New("connection reset by mirror")
	r := &eofReader{r: &failingReader{data: []byte("half"), err: boom}}
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatalf("ReadAll = %v, want the stream to end with EOF", err)
	}
	if string(b) != "half" {
		t.Errorf("read %q, want %q", b, "half")
	}
	if !errors.Is(r.Err(), boom) {
		t.Errorf("Err = %v, want %v", r.Err(), boom)
	}
	clean := &eofReader{r: strings.NewReader("all")}
	_, _ = io.ReadAll(clean)
	if clean.Err() != nil {
		t.Errorf("clean source Err = %v", clean.Err())
	}
}

// stubRPC answers DomainDefineXML and fails DomainLookupByName.
type stubRPC struct{ RPC }

func (stubRPC) DomainDefineXML(context.Context, string) (Domain, error) {
	return Domain{Name: "px-a"}, nil
}

func (stubRPC) DomainLookupByName(context.Context, string) (Domain, error) {
	return Domain{}, &Error{RPC: "virDomainLookupByName", Code: uint32(golibvirt.ErrInvalidArg), Message: "bad"}
}

func (stubRPC) StorageVolUpload(_ context.Context, _ StorageVol, r io.Reader, _ uint64) error {
	_, err := io.ReadAll(r)
	return err
}

func TestTracedLogsOneLinePerCallWithoutBodies(t *testing.T) {
	for _, verbose := range []bool{false, true} {
		var buf bytes.Buffer
		log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
		rpc := Traced(stubRPC{}, log, nil, verbose)
		ctx := context.Background()
		const secretXML = "<domain><name>px-a</name><secret-marker/></domain>"
		if _, err := rpc.DomainDefineXML(ctx, secretXML); err != nil {
			t.Fatal(err)
		}
		if _, err := rpc.DomainLookupByName(ctx, "px-a"); err == nil {
			t.Fatal("lookup: want error")
		}
		const body = "#cloud-config\npassword: hunter2\n"
		if err := rpc.StorageVolUpload(ctx, StorageVol{Name: "px-a-cidata.iso"}, strings.NewReader(body), uint64(len(body))); err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
		if len(lines) != 3 {
			t.Fatalf("verbose=%v: %d log lines, want 3:\n%s", verbose, len(lines), buf.String())
		}
		for i, rpcName := range []string{"virDomainDefineXML", "virDomainLookupByName", "virStorageVolUpload"} {
			if !strings.Contains(lines[i], `"rpc":"`+rpcName+`"`) {
				t.Errorf("line %d = %s, want rpc %s", i, lines[i], rpcName)
			}
		}
		if !strings.Contains(lines[1], `"libvirtCode":8`) || !strings.Contains(lines[1], `"class":"permanent"`) {
			t.Errorf("failure line lacks code or class: %s", lines[1])
		}
		if strings.Contains(buf.String(), "hunter2") {
			t.Errorf("an upload body reached the log:\n%s", buf.String())
		}
		if got := strings.Contains(buf.String(), "secret-marker"); got != verbose {
			t.Errorf("verbose=%v: XML in log = %v", verbose, got)
		}
	}
}

func TestChunkReaderCapsReads(t *testing.T) {
	c := &chunkReader{r: strings.NewReader(strings.Repeat("x", 100)), size: 30}
	buf := make([]byte, 4<<20)
	var sizes []int
	for {
		n, err := c.Read(buf)
		if n > 0 {
			sizes = append(sizes, n)
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	want := []int{30, 30, 30, 10}
	if len(sizes) != len(want) {
		t.Fatalf("read sizes = %v, want %v", sizes, want)
	}
	for i := range want {
		if sizes[i] != want[i] {
			t.Fatalf("read sizes = %v, want %v", sizes, want)
		}
	}
}
