// Package agentconfig is how every agent reads its configuration file:
// strict YAML (an unknown key is an error, so a typo never falls back to a
// default silently), defaults, then the agent's own checks, with every
// problem of the file reported at once in one [*Error], each naming its key
// by path ("entries[0].gce.images.debian-12").
//
// Durations in configuration files are [Duration] values ("30s").
package agentconfig

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"

	yaml "go.yaml.in/yaml/v3"

	"proxyfleet/pkg/events"
)

// Config is an agent's configuration document: it fills its own defaults,
// then adds every problem it finds to the [*Error] it is given.
type Config interface {
	Defaults()
	Check(*Error)
}

// Load reads the file at path into a new T and checks it; see [Parse]. The
// error of a file that is read names the file.
func Load[T any, P interface {
	*T
	Config
}](path string) (*T, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	c, err := Parse[T, P](b)
	if e, ok := errors.AsType[*Error](err); ok {
		e.File = path
	}
	return c, err
}

// Parse decodes a YAML document into a new T, applies its defaults and
// checks it. Problems of decoding (unknown keys, values of the wrong type)
// and of checking come back together in one [*Error].
func Parse[T any, P interface {
	*T
	Config
}](b []byte) (*T, error) {
	c := new(T)
	e := Decode(b, c)
	if e.fatal {
		return nil, e
	}
	P(c).Defaults()
	P(c).Check(e)
	if err := e.Err(); err != nil {
		return nil, err
	}
	return c, nil
}

// Problem is one thing wrong with a configuration.
type Problem struct {
	// Key is the path of the key, such as "entries[0].targets[1]"; empty
	// when the problem is the whole document's.
	Key    string
	Reason string
}

func (p Problem) String() string {
	if p.Key == "" {
		return p.Reason
	}
	return p.Key + ": " + p.Reason
}

// Error lists every problem of one configuration. Agents add to it while
// they check a document; [Error.Err] turns it into an error when it holds
// any problem.
type Error struct {
	// File is the path the document was read from, when it was.
	File     string
	Problems []Problem

	// fatal marks a document that could not be decoded at all (not YAML,
	// or empty), so there is nothing to check.
	fatal bool
}

// Add records a problem with key; the reason is formatted as by
// [fmt.Sprintf].
func (e *Error) Add(key, format string, args ...any) {
	e.add(Problem{Key: key, Reason: fmt.Sprintf(format, args...)})
}

// lineBreaks escapes line breaks as Go does in a quoted string.
var lineBreaks = strings.NewReplacer("\r", `\r`, "\n", `\n`)

// add records p on one line: the decoder's messages quote values as they
// stand, and a value or key with a line break would otherwise read as
// another problem of the list.
func (e *Error) add(p Problem) {
	p.Key, p.Reason = lineBreaks.Replace(p.Key), lineBreaks.Replace(p.Reason)
	e.Problems = append(e.Problems, p)
}

// Entry records a problem when value, the name of a provider entry an
// agent serves, breaks the identifier rule or is
// [events.ProviderExternal]: that name is reserved for the external
// pools' proxies, which no agent serves.
func (e *Error) Entry(key, value string) {
	if value == events.ProviderExternal {
		e.Add(key, "%q is reserved for external pools, whose proxies no agent serves; name the entry otherwise", value)
		return
	}
	e.Identifier(key, value)
}

// Identifier records a problem when value breaks the identifier rule
// ([events.CheckIdentifier]).
func (e *Error) Identifier(key, value string) {
	fe := events.CheckIdentifier(key, value)
	if fe == nil {
		return
	}
	if fe.Value == "" {
		e.Add(key, "%s", fe.Reason)
		return
	}
	e.Add(key, "%s, got %q", fe.Reason, fe.Value)
}

// Labels records a problem for each label of m, the map at key, that
// breaks the label rule ([events.CheckLabels]): each key and value 1-63
// lowercase letters, digits, '-' or '_', at most 16 labels.
func (e *Error) Labels(key string, m map[string]string) {
	var v events.ValidationError
	events.CheckLabels(&v, key, m)
	for _, fe := range v.Fields {
		if fe.Value == "" && fe.Field == key {
			e.Add(fe.Field, "%s", fe.Reason)
			continue
		}
		e.Add(fe.Field, "%s, got %q", fe.Reason, fe.Value)
	}
}

// TargetLabels checks labels per target, the map at key (keyed by target
// name, each value a label map as [Error.Labels] checks it): every key
// must be one of targets.
func (e *Error) TargetLabels(key string, m map[string]map[string]string, targets []string) {
	for _, t := range slices.Sorted(maps.Keys(m)) {
		path := keyPath(key, t)
		if !slices.Contains(targets, t) {
			e.Add(path, "names no listed target; the targets are %s", strings.Join(targets, ", "))
			continue
		}
		e.Labels(path, m[t])
	}
}

// KeyOf records a problem with key when its value is set but names no key
// of m, the map at mapKey (a default image naming no configured image).
func KeyOf[V any](e *Error, key, value string, m map[string]V, mapKey string) {
	if _, ok := m[value]; value != "" && !ok {
		e.Add(key, "names no key of %s: %q", mapKey, value)
	}
}

// Keyed checks a map keyed by identifiers, as every agent's images,
// profiles and templates are: each key must be an identifier, and check,
// when not nil, is called for each value with its key path ("<key>.<k>"),
// in key order so the problems come out in a stable order.
func Keyed[V any](e *Error, key string, m map[string]V, check func(path string, v V)) {
	for _, k := range slices.Sorted(maps.Keys(m)) {
		path := keyPath(key, k)
		e.Identifier(path, k)
		if check != nil {
			check(path, m[k])
		}
	}
}

// URL records a problem with key unless value is an absolute URL with a
// host and one of schemes. An empty value is left to the caller, which
// knows whether the key is required.
func (e *Error) URL(key, value string, schemes ...string) {
	if value == "" {
		return
	}
	if u, err := url.Parse(value); err != nil || !slices.Contains(schemes, u.Scheme) || u.Host == "" {
		e.Add(key, "must be an %s URL with a host, got %q", strings.Join(schemes, " or "), value)
	}
}

// Err returns e when it holds at least one problem, else nil.
func (e *Error) Err() error {
	if len(e.Problems) == 0 {
		return nil
	}
	return e
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("invalid config")
	if e.File != "" {
		b.WriteString(" " + e.File)
	}
	b.WriteString(":")
	for _, p := range e.Problems {
		b.WriteString("\n  " + p.String())
	}
	return b.String()
}

// Decode decodes the YAML document b into v, which must be a pointer, and
// returns what was wrong with it: unknown keys and values that do not fit
// their field, each named by its key path. Everything that did fit is
// decoded, so the caller can go on to check the rest of the document.
func Decode(b []byte, v any) *Error {
	e := &Error{}
	var root yaml.Node
	if err := yaml.Unmarshal(b, &root); err != nil {
		e.fatal = true
		e.Add("", "not a YAML document: %s", strings.TrimPrefix(err.Error(), "yaml: "))
		return e
	}
	if len(root.Content) == 0 {
		e.fatal = true
		e.Add("", "empty config: the file holds no keys")
		return e
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	err := dec.Decode(v)
	var te *yaml.TypeError
	switch {
	case err == nil:
	case errors.As(err, &te):
		paths := indexPaths(root.Content[0])
		for _, msg := range te.Errors {
			e.add(paths.problem(msg))
		}
	case errors.Is(err, io.EOF):
		e.fatal = true
		e.Add("", "empty config: the file holds no keys")
	default:
		e.fatal = true
		e.Add("", "%s", strings.TrimPrefix(err.Error(), "yaml: "))
	}
	if !e.fatal {
		var more yaml.Node
		if err := dec.Decode(&more); !errors.Is(err, io.EOF) && !emptyDocument(&more) {
			e.Add("", "the file holds more than one YAML document (a second \"---\"): only one is read, so merge them")
		}
	}
	return e
}

// emptyDocument reports whether n is a document with nothing in it, as
// after a trailing "---".
func emptyDocument(n *yaml.Node) bool {
	if n.Kind != yaml.DocumentNode || len(n.Content) == 0 {
		return n.Kind == 0
	}
	c := n.Content[0]
	return c.Kind == yaml.ScalarNode && c.Tag == "!!null" && c.Value == ""
}

// keyPath appends the mapping key k to path. A key holding a line break or
// another unprintable character is Go-quoted, so that every problem stays
// on its own line of the error whatever the document's keys are.
func keyPath(path, k string) string {
	if strings.IndexFunc(k, func(r rune) bool { return !strconv.IsPrint(r) }) >= 0 {
		k = strconv.Quote(k)
	}
	if path == "" {
		return k
	}
	return path + "." + k
}

// place is one key or value of the document, with its path.
type place struct {
	line  int
	key   string // the key's own name, for a mapping key
	value string // the value, for a scalar
	path  string
	// collection marks a mapping or sequence value.
	collection bool
}

// paths are the document's keys and values in document order.
type paths []place

// indexPaths lists every key and value node below n with its path.
func indexPaths(n *yaml.Node) paths {
	var out paths
	var walk func(n *yaml.Node, path string)
	walk = func(n *yaml.Node, path string) {
		if n.Kind != yaml.ScalarNode {
			out = append(out, place{line: n.Line, path: path, collection: true})
		}
		switch n.Kind {
		case yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				k, val := n.Content[i], n.Content[i+1]
				p := keyPath(path, k.Value)
				out = append(out, place{line: k.Line, key: k.Value, path: p})
				walk(val, p)
			}
		case yaml.SequenceNode:
			for i, c := range n.Content {
				walk(c, path+"["+strconv.Itoa(i)+"]")
			}
		case yaml.ScalarNode:
			out = append(out, place{line: n.Line, value: n.Value, path: path})
		}
	}
	walk(n, "")
	return out
}

// problem turns one of the decoder's messages ("line 7: field vlna not
// found in type config.Config") into a [Problem] naming the key at that
// line.
func (ps paths) problem(msg string) Problem {
	rest, ok := strings.CutPrefix(msg, "line ")
	num, reason, ok2 := strings.Cut(rest, ": ")
	line, err := strconv.Atoi(num)
	if !ok || !ok2 || err != nil {
		return Problem{Reason: msg}
	}
	if field, ok := strings.CutPrefix(reason, "field "); ok {
		if name, _, ok := strings.Cut(field, " not found in type "); ok {
			for _, p := range ps {
				if p.line == line && p.key == name {
					return Problem{Key: p.path, Reason: "unknown key (check its spelling and indentation)"}
				}
			}
		}
	}
	// A value on that line: the scalar the message quotes, else the
	// innermost collection starting there (a block mapping or sequence
	// starts on the line of its first entry, so the outer ones share it).
	for _, p := range ps {
		if p.line == line && p.key == "" && !p.collection && quotes(reason, p.value) {
			return Problem{Key: p.path, Reason: reason}
		}
	}
	for i := len(ps) - 1; i >= 0; i-- {
		if p := ps[i]; p.line == line && p.collection {
			return Problem{Key: p.path, Reason: reason}
		}
	}
	for _, p := range ps {
		if p.line == line {
			return Problem{Key: p.path, Reason: reason}
		}
	}
	return Problem{Reason: msg}
}

// quotes reports whether the decoder's message shows value: in backquotes
// (shortened past ten bytes, as the decoder does) or Go-quoted.
func quotes(msg, value string) bool {
	if len(value) > 10 && strings.Contains(msg, "`"+value[:7]+"...`") {
		return true
	}
	return strings.Contains(msg, "`"+value+"`") || strings.Contains(msg, strconv.Quote(value))
}
