package decide

import "strings"

// FallbackCycle reports whether giving pool name the fallback pools
// fallback ([events.GatewaySpec.Fallback]) closes a cycle through the
// fallbacks other pools already have, as fallbackOf gives them (nil for a
// pool that has none, is deleted or unknown). It returns the index in
// fallback of the first pool that leads back to name and the cycle, from
// name back to it ("a → b → c → a" as [CycleText] writes it). A cycle
// among other pools that does not pass through name is not this apply's:
// it is not reported (the gateway's per-request guard stops it).
func FallbackCycle(name string, fallback []string, fallbackOf func(string) []string) (int, []string, bool) {
	for i, next := range fallback {
		seen := map[string]bool{}
		if path, ok := cycleFrom(name, next, []string{name}, seen, fallbackOf); ok {
			return i, path, true
		}
	}
	return 0, nil, false
}

// cycleFrom walks the fallbacks from pool at (reached by path) depth
// first and returns the path back to name, if there is one.
func cycleFrom(name, at string, path []string, seen map[string]bool, fallbackOf func(string) []string) ([]string, bool) {
	path = append(path, at)
	if at == name {
		return path, true
	}
	if seen[at] {
		return nil, false
	}
	seen[at] = true
	for _, next := range fallbackOf(at) {
		if found, ok := cycleFrom(name, next, path, seen, fallbackOf); ok {
			return found, true
		}
	}
	return nil, false
}

// CycleText writes a cycle of pools as "a → b → a".
func CycleText(cycle []string) string { return strings.Join(cycle, " → ") }
