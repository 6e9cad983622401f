// Package config reads and validates the cloud-agent's config file: the list
// of provider entries (type gce with zones as targets, type kubernetes with
// namespaces as targets) one cloud-agent process hosts.
package config

import (
	"fmt"
	"regexp"
	"strings"
	"time"

	"proxyfleet/pkg/agentconfig"
	"proxyfleet/pkg/events"
)

// Entry types.
const (
	TypeGCE        = "gce"
	TypeKubernetes = "kubernetes"
)

// DefaultSquidImage is the container image a kubernetes entry runs when it
// names none: Ubuntu 24.04's Squid 6.6 (its C library verifies the bcrypt
// htpasswd lines of pkg/htpasswd). Pin a digest for immutable deployments.
const DefaultSquidImage = "ubuntu/squid:6.6-24.04_edge"

// DefaultSquidUser is the numeric user and group the Squid container runs
// as: "proxy" (13) in Debian and Ubuntu images.
const DefaultSquidUser = 13

// DefaultAuthHelper is where Debian and Ubuntu Squid packages install the
// basic-auth helper.
const DefaultAuthHelper = "/usr/lib/squid/basic_ncsa_auth"

// File is the whole config file.
type File struct {
	Entries []Entry `yaml:"entries"`
}

// Entry is one provider entry.
type Entry struct {
	Name    string   `yaml:"name"`
	Type    string   `yaml:"type"`
	Targets []string `yaml:"targets"`
	// Capacity is how many proxies each target may hold; 0 means unlimited.
	Capacity int `yaml:"capacity"`
	// CommandTimeout bounds one command including the wait for an address.
	CommandTimeout agentconfig.Duration `yaml:"commandTimeout"`
	// Labels are announced by every target of the entry ({provider: gce,
	// country: de}); TargetLabels adds to or overrides them per target
	// ({europe-west1-b: {region: europe-west1}}). See [Entry.LabelsOf].
	Labels       map[string]string            `yaml:"labels"`
	TargetLabels map[string]map[string]string `yaml:"targetLabels"`
	GCE          *GCE                         `yaml:"gce"`
	Kubernetes   *Kubernetes                  `yaml:"kubernetes"`
}

// GCE configures a gce entry. Targets are zones of Project.
type GCE struct {
	Project string `yaml:"project"`
	// CredentialsFile is a service-account key file; empty uses application
	// default credentials.
	CredentialsFile string `yaml:"credentialsFile"`
	// Endpoint overrides the Compute API base URL (private endpoints).
	Endpoint string `yaml:"endpoint"`
	// Images maps image keys to source images
	// ("projects/debian-cloud/global/images/family/debian-12").
	Images       map[string]string `yaml:"images"`
	DefaultImage string            `yaml:"defaultImage"`
	// Profiles maps profile keys to machine types ("e2-small").
	Profiles       map[string]string `yaml:"profiles"`
	DefaultProfile string            `yaml:"defaultProfile"`
	// Network and Subnetwork are resource paths or URLs; empty Network is
	// the project's default network.
	Network    string   `yaml:"network"`
	Subnetwork string   `yaml:"subnetwork"`
	Tags       []string `yaml:"tags"`
	// ExternalIP gives each instance an ephemeral external address, which is
	// then the proxy's address; otherwise the internal address is.
	ExternalIP  bool  `yaml:"externalIP"`
	DiskSizeGB  int64 `yaml:"diskSizeGB"`
	Preemptible bool  `yaml:"preemptible"`
}

// Kubernetes configures a kubernetes entry. Targets are namespaces.
type Kubernetes struct {
	// Kubeconfig is a kubeconfig file; empty uses the in-cluster config.
	Kubeconfig string `yaml:"kubeconfig"`
	Context    string `yaml:"context"`
	// Image is the Squid image used when a pool names no image key.
	Image string `yaml:"image"`
	// Images maps image keys to container images.
	Images map[string]string `yaml:"images"`
	// Profiles maps profile keys to resource requests and limits.
	Profiles map[string]Resources `yaml:"profiles"`
	// AuthHelper is the path of Squid's basic_ncsa_auth inside the image.
	AuthHelper string `yaml:"authHelper"`
	// RunAsUser is the numeric user (and group) of the Squid container; it
	// must not be 0 (Pod Security "restricted").
	RunAsUser int64 `yaml:"runAsUser"`
	// ClusterScope lists the entry's Pods in every namespace, so the first
	// target's inventory also reports Pods left in namespaces that are no
	// longer targets. It needs the cluster-scope RBAC overlay
	// (deploy/kubernetes/cluster-scope); by default the agent lists only
	// its target namespaces.
	ClusterScope       bool   `yaml:"clusterScope"`
	ServiceAccountName string `yaml:"serviceAccountName"`
	// ImagePullSecrets names Secrets in each target namespace.
	ImagePullSecrets []string          `yaml:"imagePullSecrets"`
	NodeSelector     map[string]string `yaml:"nodeSelector"`
}

// LabelsOf is what target announces as its labels: the entry's labels
// with the target's own over them; nil when it has none.
func (e Entry) LabelsOf(target string) map[string]string {
	return events.MergeLabels(e.Labels, e.TargetLabels[target])
}

// Resources are a Pod profile's requests and limits in Kubernetes quantity
// syntax ("100m", "128Mi").
type Resources struct {
	CPU         string `yaml:"cpu"`
	Memory      string `yaml:"memory"`
	CPULimit    string `yaml:"cpuLimit"`
	MemoryLimit string `yaml:"memoryLimit"`
}

// Load reads and validates the config file at path; its problems come
// back as one [*agentconfig.Error].
func Load(path string) (*File, error) { return agentconfig.Load[File](path) }

// Parse decodes and validates a config document. Unknown keys are errors,
// so a typo never silently falls back to a default.
func Parse(b []byte) (*File, error) { return agentconfig.Parse[File](b) }

// Defaults fills what the document leaves out.
func (f *File) Defaults() {
	for i := range f.Entries {
		e := &f.Entries[i]
		if e.Type == TypeKubernetes && e.Kubernetes == nil {
			e.Kubernetes = &Kubernetes{}
		}
		if k := e.Kubernetes; k != nil {
			if k.Image == "" {
				k.Image = DefaultSquidImage
			}
			if k.AuthHelper == "" {
				k.AuthHelper = DefaultAuthHelper
			}
			if k.RunAsUser == 0 {
				k.RunAsUser = DefaultSquidUser
			}
		}
	}
}

// gceTagRE is what GCE accepts as a network tag.
var gceTagRE = regexp.MustCompile(`^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$`)

// Check adds every problem of the file to v.
func (f *File) Check(v *agentconfig.Error) {
	if len(f.Entries) == 0 {
		v.Add("entries", "must list at least one entry")
	}
	seen := map[string]bool{}
	for i, e := range f.Entries {
		p := fmt.Sprintf("entries[%d]", i)
		if !events.IsIdentifier(e.Name) || e.Name == events.ProviderExternal {
			v.Entry(p+".name", e.Name)
		} else if seen[e.Name] {
			v.Add(p+".name", "%q is used by an earlier entry", e.Name)
		}
		seen[e.Name] = true
		if e.Capacity < 0 {
			v.Add(p+".capacity", "must be 0 (unlimited) or more, got %d", e.Capacity)
		}
		if e.CommandTimeout < 0 {
			v.Add(p+".commandTimeout", "must be positive, got %s", time.Duration(e.CommandTimeout))
		}
		if len(e.Targets) == 0 {
			v.Add(p+".targets", "must list at least one target")
		}
		tseen := map[string]bool{}
		for j, t := range e.Targets {
			tp := fmt.Sprintf("%s.targets[%d]", p, j)
			if !events.IsIdentifier(t) {
				v.Identifier(tp, t)
			} else if tseen[t] {
				v.Add(tp, "%q is listed twice", t)
			}
			tseen[t] = true
		}
		v.Labels(p+".labels", e.Labels)
		v.TargetLabels(p+".targetLabels", e.TargetLabels, e.Targets)
		for _, t := range e.Targets {
			if n := len(e.LabelsOf(t)); n > events.MaxLabels {
				v.Add(p+".targetLabels."+t, "target %s would carry %d labels with the entry's; at most %d are allowed", t, n, events.MaxLabels)
			}
		}
		switch e.Type {
		case TypeGCE:
			if e.Kubernetes != nil {
				v.Add(p+".kubernetes", "is not allowed in a gce entry")
			}
			if e.GCE == nil {
				v.Add(p+".gce", "is required for type gce")
				continue
			}
			checkGCE(v, p+".gce", e.GCE)
		case TypeKubernetes:
			if e.GCE != nil {
				v.Add(p+".gce", "is not allowed in a kubernetes entry")
			}
			checkKube(v, p+".kubernetes", e.Kubernetes)
		case "":
			v.Add(p+".type", "is required: gce or kubernetes")
		default:
			v.Add(p+".type", "must be gce or kubernetes, got %q", e.Type)
		}
	}
}

func checkGCE(v *agentconfig.Error, p string, g *GCE) {
	if g.Project == "" {
		v.Add(p+".project", "is required")
	}
	if len(g.Images) == 0 {
		v.Add(p+".images", "must map at least one image key to a source image")
	}
	agentconfig.Keyed(v, p+".images", g.Images, func(key, image string) {
		if image == "" {
			v.Add(key, "must name a source image")
		}
	})
	if len(g.Profiles) == 0 {
		v.Add(p+".profiles", "must map at least one profile key to a machine type")
	}
	agentconfig.Keyed(v, p+".profiles", g.Profiles, func(key, machineType string) {
		if machineType == "" {
			v.Add(key, "must name a machine type")
		}
	})
	agentconfig.KeyOf(v, p+".defaultImage", g.DefaultImage, g.Images, p+".images")
	agentconfig.KeyOf(v, p+".defaultProfile", g.DefaultProfile, g.Profiles, p+".profiles")
	for i, t := range g.Tags {
		if !gceTagRE.MatchString(t) {
			v.Add(fmt.Sprintf("%s.tags[%d]", p, i), "must be a network tag: lowercase letters, digits and '-', starting with a letter, got %q", t)
		}
	}
	if g.DiskSizeGB < 0 {
		v.Add(p+".diskSizeGB", "must be 0 (image size) or more, got %d", g.DiskSizeGB)
	}
	v.URL(p+".endpoint", g.Endpoint, "https", "http")
}

func checkKube(v *agentconfig.Error, p string, k *Kubernetes) {
	agentconfig.Keyed(v, p+".images", k.Images, func(key, image string) {
		if image == "" {
			v.Add(key, "must name a container image")
		} else if why := unpinned(image); why != "" {
			v.Add(key, "%s", why)
		}
	})
	if why := unpinned(k.Image); why != "" {
		v.Add(p+".image", "%s", why)
	}
	if k.RunAsUser < 0 {
		v.Add(p+".runAsUser", "must be a non-root numeric user (1 or more), got %d", k.RunAsUser)
	}
	agentconfig.Keyed(v, p+".profiles", k.Profiles, nil)
	if !strings.HasPrefix(k.AuthHelper, "/") {
		v.Add(p+".authHelper", "must be an absolute path inside the image, got %q", k.AuthHelper)
	}
}

// unpinned says why image is not pinned to a tag or digest, or "".
func unpinned(image string) string {
	if strings.Contains(image, "@sha256:") {
		return ""
	}
	name := image[strings.LastIndex(image, "/")+1:]
	_, tag, ok := strings.Cut(name, ":")
	switch {
	case !ok || tag == "":
		return fmt.Sprintf("must pin a tag or digest, got %q (it would mean :latest)", image)
	case tag == "latest":
		return fmt.Sprintf("must pin a tag or digest, not :latest, got %q", image)
	}
	return ""
}
