// Command soakplot draws the samples of a long run (make soak, soak.json;
// docs/soak.md) as one PNG: a panel each for the services' RSS,
// goroutines and open files, the streams' and buckets' messages, and the
// client's requests, with the churn's steps marked along the top of every
// panel. Only the standard library draws it: text is a 3×5 pixel font.
//
//	soakplot -in soak.json -out soak.png
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"os"
	"sort"
	"strings"
)

// sample and run are the parts of soak.json drawn.
type sample struct {
	T        float64 `json:"t"`
	Services map[string]struct {
		RSS        int64 `json:"rss_bytes"`
		Goroutines int64 `json:"goroutines"`
		FDs        int64 `json:"open_fds"`
	} `json:"services"`
	Streams map[string]struct {
		Msgs uint64 `json:"msgs"`
	} `json:"streams"`
	Proxies int `json:"proxies"`
	Traffic struct {
		Sent   int64 `json:"sent"`
		Failed int64 `json:"failed"`
	} `json:"traffic"`
}

type run struct {
	Duration string   `json:"duration"`
	Sample   string   `json:"sample"`
	Samples  []sample `json:"samples"`
	Faults   []struct {
		T    float64 `json:"t"`
		Kind string  `json:"kind"`
	} `json:"faults"`
}

// series is one line of a panel: y for each sample, NaN where unread.
type series struct {
	name string
	y    []float64
}

type panel struct {
	title string
	lines []series
}

var palette = []color.RGBA{
	{0x1f, 0x77, 0xb4, 255}, {0xff, 0x7f, 0x0e, 255}, {0x2c, 0xa0, 0x2c, 255}, {0xd6, 0x27, 0x28, 255},
	{0x94, 0x67, 0xbd, 255}, {0x8c, 0x56, 0x4b, 255}, {0xe3, 0x77, 0xc2, 255}, {0x7f, 0x7f, 0x7f, 255},
	{0xbc, 0xbd, 0x22, 255}, {0x17, 0xbe, 0xcf, 255}, {0x39, 0x3b, 0x79, 255}, {0x63, 0x79, 0x39, 255},
}

// faultColor marks each kind of churn step.
var faultColor = map[string]color.RGBA{
	"scale":           {0x7f, 0x7f, 0x7f, 255},
	"kill-proxy":      {0xd6, 0x27, 0x28, 255},
	"recycle":         {0x2c, 0xa0, 0x2c, 255},
	"restart-health":  {0xff, 0x7f, 0x0e, 255},
	"restart-planner": {0x94, 0x67, 0xbd, 255},
}

func main() {
	in := flag.String("in", "soak.json", "the samples of a long run (make soak writes soak.json)")
	out := flag.String("out", "soak.png", "the PNG to write")
	flag.Parse()
	b, err := os.ReadFile(*in)
	if err != nil {
		fail(fmt.Errorf("read the samples: %w (make soak writes them)", err))
	}
	var r run
	if err := json.Unmarshal(b, &r); err != nil {
		fail(fmt.Errorf("%s: %w", *in, err))
	}
	if len(r.Samples) < 2 {
		fail(fmt.Errorf("%s: %d samples; at least 2 are needed to draw", *in, len(r.Samples)))
	}
	img := draw(&r)
	f, err := os.Create(*out)
	if err != nil {
		fail(err)
	}
	if err := png.Encode(f, img); err != nil {
		fail(err)
	}
	if err := f.Close(); err != nil {
		fail(err)
	}
	fmt.Printf("soakplot: %d samples over %s drawn to %s\n", len(r.Samples), r.Duration, *out)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "soakplot:", err)
	os.Exit(1)
}

func panels(r *run) []panel {
	var services []string
	for n := range r.Samples[0].Services {
		services = append(services, n)
	}
	sort.Strings(services)
	proc := func(title string, get func(s sample, n string) float64) panel {
		p := panel{title: title}
		for _, n := range services {
			l := series{name: n}
			for _, s := range r.Samples {
				l.y = append(l.y, get(s, n))
			}
			p.lines = append(p.lines, l)
		}
		return p
	}
	val := func(v int64, scale float64) float64 {
		if v < 0 {
			return math.NaN()
		}
		return float64(v) / scale
	}
	ps := []panel{
		proc("RSS (MIB)", func(s sample, n string) float64 { return val(s.Services[n].RSS, 1<<20) }),
		proc("GOROUTINES", func(s sample, n string) float64 { return val(s.Services[n].Goroutines, 1) }),
		proc("OPEN FILES", func(s sample, n string) float64 { return val(s.Services[n].FDs, 1) }),
	}
	streams := map[string]bool{}
	for _, s := range r.Samples {
		for k := range s.Streams {
			streams[k] = true
		}
	}
	var names []string
	for k := range streams {
		names = append(names, k)
	}
	sort.Strings(names)
	// Only the streams and buckets whose size changed: the others are
	// listed in soak.json.
	st := panel{title: "STREAM AND BUCKET MESSAGES (LOG10), THOSE THAT CHANGED"}
	for _, k := range names {
		l := series{name: k}
		changed := false
		for _, s := range r.Samples {
			changed = changed || s.Streams[k].Msgs != r.Samples[0].Streams[k].Msgs
			l.y = append(l.y, math.Log10(float64(s.Streams[k].Msgs)+1))
		}
		if changed {
			st.lines = append(st.lines, l)
		}
	}
	ps = append(ps, st)
	tr := panel{title: "CLIENT REQUESTS PER S, FAILED, PROXY PROCESSES"}
	sent, failed, proxies := series{name: "requests/s"}, series{name: "failed"}, series{name: "proxy processes"}
	for i, s := range r.Samples {
		if i == 0 {
			sent.y = append(sent.y, math.NaN())
			failed.y = append(failed.y, 0)
		} else {
			dt := s.T - r.Samples[i-1].T
			sent.y = append(sent.y, float64(s.Traffic.Sent-r.Samples[i-1].Traffic.Sent)/dt)
			failed.y = append(failed.y, float64(s.Traffic.Failed))
		}
		proxies.y = append(proxies.y, float64(s.Proxies))
	}
	tr.lines = []series{sent, failed, proxies}
	return append(ps, tr)
}

const (
	width   = 1400
	panelH  = 200
	left    = 70
	right   = 330 // the legend
	top     = 40
	gap     = 30
	plotW   = width - left - right
	scaleUp = 2 // the font's pixels
)

func draw(r *run) *image.RGBA {
	ps := panels(r)
	height := top + len(ps)*(panelH+gap) + 20
	img := image.NewRGBA(image.Rect(0, 0, width, height))
	fill(img, img.Bounds(), color.RGBA{255, 255, 255, 255})
	t0, t1 := r.Samples[0].T, r.Samples[len(r.Samples)-1].T
	text(img, left, 10, fmt.Sprintf("PROXYFLEET LONG RUN: %s, A SAMPLE EVERY %s", strings.ToUpper(r.Duration), strings.ToUpper(r.Sample)), color.RGBA{0, 0, 0, 255})
	// The churn steps' legend, top right.
	kinds := []string{"scale", "kill-proxy", "recycle", "restart-health", "restart-planner"}
	x := width - right + 10
	for i, k := range kinds {
		y := 8 + (i%3)*12
		xx := x + (i/3)*160
		fill(img, image.Rect(xx, y, xx+3, y+10), faultColor[k])
		text(img, xx+8, y, strings.ToUpper(k), color.RGBA{0, 0, 0, 255})
	}
	xOf := func(t float64) int { return left + int(float64(plotW)*(t-t0)/math.Max(t1-t0, 1)) }
	for pi, p := range ps {
		y0 := top + pi*(panelH+gap) + 14
		area := image.Rect(left, y0, left+plotW, y0+panelH)
		text(img, left, y0-14, p.title, color.RGBA{0, 0, 0, 255})
		fill(img, area, color.RGBA{0xf7, 0xf7, 0xf7, 255})
		lo, hi := math.Inf(1), math.Inf(-1)
		for _, l := range p.lines {
			for _, v := range l.y {
				if !math.IsNaN(v) {
					lo, hi = math.Min(lo, v), math.Max(hi, v)
				}
			}
		}
		lo = math.Min(lo, 0)
		if hi <= lo {
			hi = lo + 1
		}
		hi *= 1.05
		yOf := func(v float64) int { return area.Max.Y - 1 - int(float64(panelH-1)*(v-lo)/(hi-lo)) }
		// Axes: the top and bottom values, and minutes along the bottom.
		text(img, 4, area.Min.Y, short(hi), color.RGBA{0x44, 0x44, 0x44, 255})
		text(img, 4, area.Max.Y-10, short(lo), color.RGBA{0x44, 0x44, 0x44, 255})
		for m := 0.0; m <= (t1-t0)/60; m += minuteStep((t1 - t0) / 60) {
			xx := xOf(t0 + m*60)
			fill(img, image.Rect(xx, area.Min.Y, xx+1, area.Max.Y), color.RGBA{0xdd, 0xdd, 0xdd, 255})
			text(img, xx-4, area.Max.Y+3, fmt.Sprintf("%gM", m), color.RGBA{0x44, 0x44, 0x44, 255})
		}
		// The run's halves, which the bounds compare.
		mid := xOf(r.Samples[len(r.Samples)/2].T)
		for yy := area.Min.Y; yy < area.Max.Y; yy += 6 {
			fill(img, image.Rect(mid, yy, mid+1, yy+3), color.RGBA{0, 0, 0, 255})
		}
		for _, f := range r.Faults {
			xx := xOf(f.T)
			fill(img, image.Rect(xx, area.Min.Y, xx+2, area.Min.Y+8), faultColor[f.Kind])
		}
		for li, l := range p.lines {
			c := palette[li%len(palette)]
			px, py := -1, -1
			for i, v := range l.y {
				if math.IsNaN(v) {
					px = -1
					continue
				}
				x, y := xOf(r.Samples[i].T), yOf(v)
				if px >= 0 {
					line(img, px, py, x, y, c)
				} else {
					fill(img, image.Rect(x-1, y-1, x+2, y+2), c)
				}
				px, py = x, y
			}
			ly := y0 + li*12
			if ly+10 > y0+panelH {
				continue // more lines than the legend holds
			}
			fill(img, image.Rect(left+plotW+10, ly+3, left+plotW+22, ly+6), c)
			text(img, left+plotW+26, ly, strings.ToUpper(l.name), color.RGBA{0, 0, 0, 255})
		}
	}
	return img
}

func minuteStep(total float64) float64 {
	for _, s := range []float64{0.5, 1, 2, 5, 10, 15, 30, 60} {
		if total/s <= 12 {
			return s
		}
	}
	return 120
}

// short writes v in at most a few characters.
func short(v float64) string {
	switch a := math.Abs(v); {
	case a >= 1e6:
		return fmt.Sprintf("%.1fM", v/1e6)
	case a >= 1e4:
		return fmt.Sprintf("%.0fK", v/1e3)
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	default:
		return fmt.Sprintf("%.1f", v)
	}
}

func fill(img *image.RGBA, r image.Rectangle, c color.RGBA) {
	r = r.Intersect(img.Bounds())
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			img.SetRGBA(x, y, c)
		}
	}
}

// line draws a 2-pixel line from (x0, y0) to (x1, y1).
func line(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA) {
	n := max(abs(x1-x0), abs(y1-y0), 1)
	for i := 0; i <= n; i++ {
		x := x0 + (x1-x0)*i/n
		y := y0 + (y1-y0)*i/n
		fill(img, image.Rect(x, y, x+2, y+2), c)
	}
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

// glyphs is a 3×5 pixel font: five rows of three pixels a character.
var glyphs = map[rune]string{
	'0': "111101101101111", '1': "010110010010111", '2': "111001111100111", '3': "111001111001111",
	'4': "101101111001001", '5': "111100111001111", '6': "111100111101111", '7': "111001001001001",
	'8': "111101111101111", '9': "111101111001111",
	'A': "010101111101101", 'B': "110101110101110", 'C': "011100100100011", 'D': "110101101101110",
	'E': "111100110100111", 'F': "111100110100100", 'G': "011100101101011", 'H': "101101111101101",
	'I': "111010010010111", 'J': "001001001101010", 'K': "101101110101101", 'L': "100100100100111",
	'M': "101111111101101", 'N': "110101101101101", 'O': "010101101101010", 'P': "110101110100100",
	'Q': "010101101110011", 'R': "110101110101101", 'S': "011100010001110", 'T': "111010010010010",
	'U': "101101101101111", 'V': "101101101101010", 'W': "101101111111101", 'X': "101101010101101",
	'Y': "101101010010010", 'Z': "111001010100111",
	'-': "000000111000000", '.': "000000000000010", '/': "001001010100100", ':': "000010000010000",
	'(': "010100100100010", ')': "010001001001010", '_': "000000000000111", ',': "000000000010100",
	' ': "000000000000000",
}

// text writes s at (x, y), its top left, in the 3×5 font scaled up.
func text(img *image.RGBA, x, y int, s string, c color.RGBA) {
	for _, r := range strings.ToUpper(s) {
		g, ok := glyphs[r]
		if !ok {
			g = glyphs['-']
		}
		for i, bit := range g {
			if bit == '1' {
				px, py := x+(i%3)*scaleUp, y+(i/3)*scaleUp
				fill(img, image.Rect(px, py, px+scaleUp, py+scaleUp), c)
			}
		}
		x += 4 * scaleUp
	}
}
