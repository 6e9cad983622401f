package apiserver

import (
	"bytes"
	"encoding"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strconv"
	"strings"
	"unicode/utf8"

	"proxyfleet/pkg/api"
	"proxyfleet/pkg/events"
)

// bodyPath names the request body as a whole in an error, where no field
// is to blame (malformed JSON, not an object).
const bodyPath = "(body)"

// notText refuses a string encoding/json would silently rewrite: invalid
// UTF-8 and unpaired surrogate escapes both decode to U+FFFD.
const notText = "must be valid UTF-8 text (invalid bytes and unpaired surrogates are refused, and so is U+FFFD)"

// validText reports whether a decoded JSON string holds no U+FFFD, the
// mark encoding/json leaves for what was not text.
func validText(s string) bool { return !strings.ContainsRune(s, utf8.RuneError) }

// badRequest refuses a request that cannot be read. field is the path of
// the offending value ("auth.username", "targets[1]"), or "" for the body
// as a whole; the message starts with it.
func badRequest(field, msg string) *api.APIError {
	if field == "" {
		field = bodyPath
	}
	return &api.APIError{Status: "400", Code: api.CodeBadRequest, Message: field + ": " + msg,
		Fields: []events.FieldError{{Field: field, Reason: msg}}}
}

// decodeStrict decodes a JSON object into out (a pointer to a struct). It
// refuses what encoding/json lets through: keys that match a field only
// case-insensitively, duplicate keys at any depth, trailing data. Every
// error names the offending value by path ("auth.username",
// "targets[1]"). allowEmpty accepts an empty body as an empty object.
func decodeStrict(data []byte, out any, allowEmpty bool) *api.APIError {
	_, aerr := decodeStrictPresent(data, out, allowEmpty)
	return aerr
}

// decodeStrictPresent is [decodeStrict] that also returns the paths of the
// object keys that carried a value other than null, so a handler can tell
// a field left out (or null) from one set to its zero value.
func decodeStrictPresent(data []byte, out any, allowEmpty bool) (map[string]bool, *api.APIError) {
	if len(bytes.TrimSpace(data)) == 0 {
		if allowEmpty {
			return map[string]bool{}, nil
		}
		return nil, badRequest("", "is empty; send a JSON object")
	}
	present, aerr := checkStrict(data, reflect.TypeOf(out))
	if aerr != nil {
		return nil, aerr
	}
	// The walk accepted every key and value, so this decode refuses
	// nothing but what the walk does not model; such an error still names
	// what it can.
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(out); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return nil, badRequest(te.Field, fmt.Sprintf("must be %s, got %s", jsonKind(te.Type), te.Value))
		}
		return nil, badRequest("", err.Error())
	}
	return present, nil
}

// checkStrict walks the JSON in data token by token against type t (the
// json tags of its structs, through pointers, slices and maps) and returns
// the paths of the object keys with a non-null value. Null is accepted
// wherever encoding/json accepts it (it leaves the zero value); required
// fields are the handler's business.
func checkStrict(data []byte, t reflect.Type) (map[string]bool, *api.APIError) {
	if !json.Valid(data) {
		// Unmarshal's syntax error carries the exact offset; the
		// streaming decoder's may not.
		return nil, syntaxError(json.Unmarshal(data, new(any)))
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	w := &walker{dec: dec, present: map[string]bool{}}
	tok, err := dec.Token()
	if err != nil {
		return nil, syntaxError(err)
	}
	if tok == nil {
		return nil, badRequest("", "must be a JSON object, not null")
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, badRequest("", "must be a JSON object")
	}
	if aerr := w.object("", deref(t)); aerr != nil {
		return nil, aerr
	}
	return w.present, nil
}

type walker struct {
	dec     *json.Decoder
	present map[string]bool
	// null is whether the value just checked was the literal null.
	null bool
}

var (
	jsonUnmarshaler = reflect.TypeFor[json.Unmarshaler]()
	textUnmarshaler = reflect.TypeFor[encoding.TextUnmarshaler]()
)

func deref(t reflect.Type) reflect.Type {
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t
}

// value checks the next JSON value against t; a nil t accepts any value
// (its objects are still checked for duplicate keys).
func (w *walker) value(path string, t reflect.Type) *api.APIError {
	w.null = false
	t = deref(t)
	if t != nil && (reflect.PointerTo(t).Implements(jsonUnmarshaler) || reflect.PointerTo(t).Implements(textUnmarshaler)) {
		return w.opaque(path, t)
	}
	if t != nil && t.Kind() == reflect.Interface {
		t = nil
	}
	tok, err := w.dec.Token()
	if err != nil {
		return syntaxError(err)
	}
	if s, ok := tok.(string); ok && !validText(s) {
		return badRequest(path, notText)
	}
	if tok == nil {
		w.null = true
		return nil
	}
	if d, ok := tok.(json.Delim); ok {
		switch {
		case d == '{' && (t == nil || t.Kind() == reflect.Struct || t.Kind() == reflect.Map):
			aerr := w.object(path, t)
			w.null = false
			return aerr
		case d == '[' && (t == nil || ((t.Kind() == reflect.Slice || t.Kind() == reflect.Array) && !isBytes(t))):
			var elem reflect.Type
			if t != nil {
				elem = t.Elem()
			}
			aerr := w.array(path, elem)
			w.null = false
			return aerr
		}
		return badRequest(path, fmt.Sprintf("must be %s, got %s", jsonKind(t), tokenKind(tok)))
	}
	if t == nil {
		return nil
	}
	want := jsonKind(t)
	switch v := tok.(type) {
	case string:
		if t.Kind() == reflect.String || isBytes(t) {
			return nil
		}
	case bool:
		if t.Kind() == reflect.Bool {
			return nil
		}
	case json.Number:
		var err error
		switch t.Kind() {
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
			_, err = strconv.ParseInt(string(v), 10, t.Bits())
		case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
			_, err = strconv.ParseUint(string(v), 10, t.Bits())
		case reflect.Float32, reflect.Float64:
			_, err = strconv.ParseFloat(string(v), t.Bits())
		default:
			err = errors.New("not a number")
		}
		if err == nil {
			return nil
		}
		if t.Kind() >= reflect.Int && t.Kind() <= reflect.Float64 {
			if errors.Is(err, strconv.ErrRange) {
				return badRequest(path, fmt.Sprintf("is out of range, got number %s", clip(string(v))))
			}
			return badRequest(path, fmt.Sprintf("must be %s, got number %s", want, clip(string(v))))
		}
	}
	return badRequest(path, fmt.Sprintf("must be %s, got %s", want, tokenKind(tok)))
}

// opaque checks a value whose type decodes itself (a duration, say): its
// raw JSON is checked for duplicate keys, then decoded on its own so its
// error is reported at its path.
func (w *walker) opaque(path string, t reflect.Type) *api.APIError {
	var raw json.RawMessage
	if err := w.dec.Decode(&raw); err != nil {
		return syntaxError(err)
	}
	sub := &walker{dec: json.NewDecoder(bytes.NewReader(raw)), present: map[string]bool{}}
	sub.dec.UseNumber()
	if aerr := sub.value(path, nil); aerr != nil {
		return aerr
	}
	w.null = bytes.Equal(bytes.TrimSpace(raw), []byte("null"))
	if err := json.Unmarshal(raw, reflect.New(t).Interface()); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return badRequest(path, fmt.Sprintf("must be %s, got %s", jsonKind(te.Type), te.Value))
		}
		return badRequest(path, err.Error())
	}
	return nil
}

// object checks the members of an object whose '{' was read: t is a
// struct (keys must match its json names exactly), a map (any key), or
// nil (any key, any value).
func (w *walker) object(path string, t reflect.Type) *api.APIError {
	var fields map[string]reflect.Type
	var elem reflect.Type
	switch {
	case t == nil:
	case t.Kind() == reflect.Struct:
		fields = map[string]reflect.Type{}
		jsonFields(t, fields)
	case t.Kind() == reflect.Map:
		elem = t.Elem()
	}
	seen := map[string]bool{}
	for w.dec.More() {
		tok, err := w.dec.Token()
		if err != nil {
			return syntaxError(err)
		}
		key, _ := tok.(string)
		kp := joinPath(path, key)
		if !validText(key) {
			return badRequest(kp, notText)
		}
		if seen[key] {
			return badRequest(kp, "duplicate key")
		}
		seen[key] = true
		ft := elem
		if fields != nil {
			var ok bool
			if ft, ok = fields[key]; !ok {
				return badRequest(kp, unknownField(key, fields))
			}
		}
		if aerr := w.value(kp, ft); aerr != nil {
			return aerr
		}
		if !w.null {
			w.present[kp] = true
		}
	}
	if _, err := w.dec.Token(); err != nil {
		return syntaxError(err)
	}
	return nil
}

// array checks the elements of an array whose '[' was read.
func (w *walker) array(path string, elem reflect.Type) *api.APIError {
	for i := 0; w.dec.More(); i++ {
		if aerr := w.value(path+"["+strconv.Itoa(i)+"]", elem); aerr != nil {
			return aerr
		}
	}
	if _, err := w.dec.Token(); err != nil {
		return syntaxError(err)
	}
	return nil
}

// jsonFields adds the JSON names of t's fields as encoding/json sees them,
// with the fields of untagged embedded structs promoted.
func jsonFields(t reflect.Type, into map[string]reflect.Type) {
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, opts, _ := strings.Cut(tag, ",")
		if f.Anonymous && name == "" {
			if et := deref(f.Type); et.Kind() == reflect.Struct {
				jsonFields(et, into)
				continue
			}
		}
		if !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		ft := f.Type
		if opts == "string" || strings.HasPrefix(opts, "string,") || strings.Contains(opts, ",string") {
			ft = reflect.TypeFor[string]()
		}
		if _, dup := into[name]; !dup {
			into[name] = ft
		}
	}
}

func unknownField(key string, fields map[string]reflect.Type) string {
	for name := range fields {
		if strings.EqualFold(name, key) {
			return "unknown field; keys are case-sensitive: did you mean " + strconv.Quote(name) + "?"
		}
	}
	return "unknown field"
}

// joinPath appends an object key to a path. Keys that are not plain words
// are quoted, and long ones clipped, so an error message stays one
// readable line whatever the client sent.
func joinPath(path, key string) string {
	k := clip(key)
	plain := k != ""
	for _, r := range k {
		if !(r == '_' || r == '-' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z') {
			plain = false
			break
		}
	}
	if !plain {
		k = strconv.Quote(k)
	}
	if path == "" {
		return k
	}
	return path + "." + k
}

// clip shortens s for an error message.
func clip(s string) string {
	const max = 64
	if len(s) <= max {
		return s
	}
	return strings.ToValidUTF8(s[:max], "") + "…"
}

func isBytes(t reflect.Type) bool {
	return t.Kind() == reflect.Slice && t.Elem().Kind() == reflect.Uint8
}

// tokenKind names the kind of a JSON token as encoding/json's errors do.
func tokenKind(tok json.Token) string {
	switch v := tok.(type) {
	case json.Delim:
		if v == '{' {
			return "object"
		}
		return "array"
	case string:
		return "string"
	case bool:
		return "bool"
	case json.Number:
		return "number"
	}
	return "null"
}

func syntaxError(err error) *api.APIError {
	var se *json.SyntaxError
	switch {
	case errors.As(err, &se):
		return badRequest("", fmt.Sprintf("malformed JSON at byte %d: %s", se.Offset, se.Error()))
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return badRequest("", "malformed JSON: unexpected end of input")
	}
	return badRequest("", "malformed JSON: "+err.Error())
}

func jsonKind(t reflect.Type) string {
	if t == nil {
		return "another type"
	}
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Slice, reflect.Array:
		if isBytes(t) {
			return "a base64 string"
		}
		return "an array"
	case reflect.Struct, reflect.Map, reflect.Pointer:
		return "an object"
	}
	return t.String()
}
