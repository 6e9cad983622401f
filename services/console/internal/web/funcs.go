package web

import (
	"encoding/json"
	"fmt"
	"html/template"
	"strings"
	"time"

	"proxyfleet/pkg/telemetry"
	"proxyfleet/services/console/internal/fleetview"
)

// funcs are the templates' functions.
var funcs = template.FuncMap{
	// redact hides the password of any URL in a text that comes from the
	// fleet (a reason, a probe's error, a check's detail): none should
	// hold one, and none is shown if one does.
	"redact": telemetry.RedactURL,
	"clock": func(t time.Time) string {
		if t.IsZero() {
			return "–"
		}
		return t.UTC().Format("15:04:05 UTC")
	},
	"iso": func(t time.Time) string { return t.UTC().Format(time.RFC3339) },
	"ago": func(t time.Time) string {
		if t.IsZero() {
			return "never"
		}
		return since(t, time.Now()) + " ago"
	},
	"rate": func(f float64) string {
		switch {
		case f == 0:
			return "0"
		case f < 10:
			return fmt.Sprintf("%.2f", f)
		case f < 100:
			return fmt.Sprintf("%.1f", f)
		default:
			return fmt.Sprintf("%.0f", f)
		}
	},
	"pct": func(f float64) string {
		if f == 0 {
			return "0%"
		}
		return fmt.Sprintf("%.1f%%", 100*f)
	},
}

// since is the time from t to now in a short human form: "42s", "5m",
// "3h12m", "2d4h".
func since(t time.Time, now time.Time) string {
	if t.IsZero() {
		return "–"
	}
	d := now.Sub(t)
	if d < 0 {
		d = 0
	}
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%dm", int(d.Hours()), int(d.Minutes())%60)
	default:
		return fmt.Sprintf("%dd%dh", int(d.Hours())/24, int(d.Hours())%24)
	}
}

func compactJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return "(unreadable)"
	}
	return string(b)
}

// historySVG draws a pool's ready (solid) against desired (dashed) counts
// as an inline SVG of w×h, styled by console.css (no inline style). It
// holds numbers and the pool's name (an identifier) only, escaped anyway.
func historySVG(pool string, hist []fleetview.Sample, w, h int) template.HTML {
	label := fmt.Sprintf("Ready against desired proxies of %s: no history yet", pool)
	var b strings.Builder
	if len(hist) > 0 {
		last := hist[len(hist)-1]
		label = fmt.Sprintf("Ready against desired proxies of %s over the last %d samples: now %d ready of %d desired", pool, len(hist), last.Ready, last.Desired)
	}
	esc := template.HTMLEscapeString(label)
	fmt.Fprintf(&b, `<svg class="hist" width="%d" height="%d" viewBox="0 0 %d %d" role="img" aria-label="%s"><title>%s</title>`, w, h, w, h, esc, esc)
	fmt.Fprintf(&b, `<rect class="hist-frame" x="0.5" y="0.5" width="%d" height="%d"></rect>`, w-1, h-1)
	if len(hist) > 0 {
		top := 1
		for _, s := range hist {
			top = max(top, s.Desired, s.Ready)
		}
		x := func(i int) float64 {
			if fleetview.HistoryLen <= 1 {
				return 2
			}
			// The newest sample at the right edge.
			return float64(w-2) - float64(len(hist)-1-i)*float64(w-4)/float64(fleetview.HistoryLen-1)
		}
		y := func(n int) float64 { return float64(h-3) - float64(n)*float64(h-6)/float64(top) }
		line := func(class string, get func(fleetview.Sample) int) {
			fmt.Fprintf(&b, `<polyline class="%s" points="`, class)
			for i, s := range hist {
				if i > 0 {
					b.WriteByte(' ')
				}
				fmt.Fprintf(&b, "%.1f,%.1f", x(i), y(get(s)))
			}
			b.WriteString(`"></polyline>`)
		}
		line("hist-desired", func(s fleetview.Sample) int { return s.Desired })
		line("hist-ready", func(s fleetview.Sample) int { return s.Ready })
	}
	b.WriteString(`</svg>`)
	return template.HTML(b.String())
}
