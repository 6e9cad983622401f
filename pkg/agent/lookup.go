package agent

import (
	"cmp"
	"maps"
	"slices"
	"strings"
)

// Lookup returns the value that key, or def when key is empty, has in m:
// one of an entry's images, profiles or templates, chosen by the pool's
// key or the entry's default. what names the kind of key in the error
// ("image", "profile"). A key m does not hold, or no key at all, is a
// permanent error that names the keys m does hold.
func Lookup[V any](entry, what string, m map[string]V, key, def string) (V, error) {
	k := cmp.Or(key, def)
	v, ok := m[k]
	switch {
	case k == "":
		return v, Wrapf(ErrPermanent, "the pool names no %s and entry %s has no default one (configured: %s)", what, entry, keyList(m))
	case !ok:
		return v, Wrapf(ErrPermanent, "%s %q is not configured in entry %s (configured: %s)", what, k, entry, keyList(m))
	}
	return v, nil
}

func keyList[V any](m map[string]V) string {
	if len(m) == 0 {
		return "none"
	}
	return strings.Join(slices.Sorted(maps.Keys(m)), ", ")
}
