package console

import (
	"fmt"
	"html/template"
	"math"
	"strconv"
	"strings"

	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

// Charts are drawn here as inline SVG, server-side: a chart library would
// mean a build step or assets to vendor, for four line charts. The
// numbers come from pgstatus.History (every process's sampled counters).

// series is one line of a chart.
type series struct {
	Name  string
	Color string
	Vals  []*float64
}

type chart struct {
	ID    string
	Title string
	Unit  string
	Lines []series
}

const (
	chartW, chartH = 320.0, 110.0
	plotL, plotR   = 4.0, 316.0
	plotT, plotB   = 22.0, 92.0
)

func overviewCharts(pts []pgstatus.Point) []chart {
	pending := make([]*float64, len(pts))
	rate := make([]*float64, len(pts))
	p95 := make([]*float64, len(pts))
	handled := make([]*float64, len(pts))
	failed := make([]*float64, len(pts))
	for i, p := range pts {
		pending[i] = p.Pending
		rate[i] = p.DispatchedPerS
		p95[i] = p.LatencyP95S
		handled[i] = p.HandledPerS
		failed[i] = p.FailedPerS
	}
	return []chart{
		{ID: "chart-depth", Title: "Outbox depth", Unit: "rows", Lines: []series{{"pending", "#1d4ed8", pending}}},
		{ID: "chart-dispatch", Title: "Dispatched", Unit: "/s", Lines: []series{{"dispatched", "#1d4ed8", rate}}},
		{ID: "chart-latency", Title: "Dispatch latency p95", Unit: "s", Lines: []series{{"p95", "#7c3aed", p95}}},
		{ID: "chart-handlers", Title: "Handlers", Unit: "/s", Lines: []series{{"handled", "#1e7b34", handled}, {"failed", "#b3261e", failed}}},
	}
}

// num prints a value for a label: few digits, no exponent.
func num(v float64) string {
	switch {
	case v == 0:
		return "0"
	case math.Abs(v) >= 100:
		return strconv.FormatFloat(math.Round(v), 'f', -1, 64)
	case math.Abs(v) >= 1:
		return strconv.FormatFloat(v, 'f', 1, 64)
	default:
		return strconv.FormatFloat(v, 'g', 2, 64)
	}
}

// SVG renders the chart. What a screen reader hears is the summary in
// aria-label: the last value and the highest of the hour, per line.
func (c chart) SVG() template.HTML {
	top := 0.0
	for _, l := range c.Lines {
		for _, v := range l.Vals {
			if v != nil {
				top = max(top, *v)
			}
		}
	}
	empty := top == 0
	if top == 0 {
		top = 1
	}
	var b strings.Builder
	var summary []string
	for _, l := range c.Lines {
		last, high, any := 0.0, 0.0, false
		for _, v := range l.Vals {
			if v != nil {
				last, high, any = *v, max(high, *v), true
			}
		}
		if any {
			summary = append(summary, fmt.Sprintf("%s latest %s %s, highest %s %s", l.Name, num(last), c.Unit, num(high), c.Unit))
		} else {
			summary = append(summary, l.Name+": no data")
		}
	}
	label := c.Title + ", last hour: " + strings.Join(summary, "; ")
	fmt.Fprintf(&b, `<svg id="%s" class="chart" role="img" viewBox="0 0 %g %g" aria-label="%s"><title>%s</title>`,
		c.ID, chartW, chartH, template.HTMLEscapeString(label), template.HTMLEscapeString(label))
	fmt.Fprintf(&b, `<text x="%g" y="14" class="ct">%s <tspan class="cm">(max %s %s)</tspan></text>`, plotL, template.HTMLEscapeString(c.Title), num(top), template.HTMLEscapeString(c.Unit))
	if empty {
		fmt.Fprintf(&b, `<text x="%g" y="60" class="cm" text-anchor="middle">no data in the last hour</text>`, (plotL+plotR)/2)
	}
	fmt.Fprintf(&b, `<line x1="%g" y1="%g" x2="%g" y2="%g" class="ax"/>`, plotL, plotB, plotR, plotB)
	for _, l := range c.Lines {
		n := len(l.Vals)
		var seg []string
		flush := func() {
			if len(seg) == 1 {
				xy := strings.Split(seg[0], ",")
				fmt.Fprintf(&b, `<circle cx="%s" cy="%s" r="1.5" fill="%s"/>`, xy[0], xy[1], l.Color)
			} else if len(seg) > 1 {
				fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>`, l.Color, strings.Join(seg, " "))
			}
			seg = seg[:0]
		}
		for i, v := range l.Vals {
			if v == nil {
				flush()
				continue
			}
			x := plotL + (plotR-plotL)*float64(i)/float64(max(n-1, 1))
			y := plotB - (plotB-plotT)*(*v/top)
			seg = append(seg, strconv.FormatFloat(x, 'f', 1, 64)+","+strconv.FormatFloat(y, 'f', 1, 64))
		}
		flush()
	}
	fmt.Fprintf(&b, `<text x="%g" y="106" class="cm">−60 min</text><text x="%g" y="106" class="cm" text-anchor="end">now</text>`, plotL, plotR)
	if len(c.Lines) > 1 {
		x := 120.0
		for _, l := range c.Lines {
			fmt.Fprintf(&b, `<text x="%g" y="106" class="cl" fill="%s">— %s</text>`, x, l.Color, template.HTMLEscapeString(l.Name))
			x += 72
		}
	}
	b.WriteString(`</svg>`)
	return template.HTML(b.String()) // built here from numbers and escaped names only
}
