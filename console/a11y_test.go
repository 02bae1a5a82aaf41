package console_test

import (
	"fmt"
	"math"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/html"
)

// Every page, logged in (the forms are there), is readable by a screen
// reader: each control visible to the user has a name (a label, or
// aria-label), each table header has a scope, and the page has its
// landmarks (navigation, main).
func TestPagesNameEveryControl(t *testing.T) {
	t.Parallel()
	srv, pool := setup(t)
	rowID := pipelinetest.InsertOutbox(t, pool, testTable, pipelinetest.OutboxRow{AggregateID: "f1", Topic: "stripe.charge",
		Attempts: 7, LastError: "publishing: NOT_FOUND", AvailableAt: time.Now().Add(10 * time.Minute)})[0]
	poisonID := slices.Min(pipelinetest.PoisonIDs(t, pool, pgpoison.Filter{}))
	browser := loggedIn(t, srv)
	for _, path := range []string{"/console/", "/console/retrying", "/console/failing", "/console/poison", "/console/poison?group=1",
		"/console/audit", "/console/poison/" + strconv.FormatInt(poisonID, 10), "/console/failing/" + strconv.FormatInt(rowID, 10), "/console/login",
		"/console/handlers", "/console/search", "/console/search?q=order-2"} {
		code, body := get(t, browser, srv.URL+path)
		require.Equal(t, 200, code, path)
		doc, err := html.Parse(strings.NewReader(body))
		require.NoError(t, err, path)
		for _, p := range unnamed(doc) {
			t.Errorf("%s: %s", path, p)
		}
		require.Contains(t, body, "<main>", path)
		require.Contains(t, body, "<nav ", path)
	}
}

func attr(n *html.Node, key string) (string, bool) {
	for _, a := range n.Attr {
		if a.Key == key {
			return a.Val, true
		}
	}
	return "", false
}

// unnamed lists the controls without an accessible name and the table
// headers without a scope.
func unnamed(doc *html.Node) []string {
	labelled := map[string]bool{}
	var walk func(*html.Node, bool, func(*html.Node, bool))
	walk = func(n *html.Node, inLabel bool, f func(*html.Node, bool)) {
		f(n, inLabel)
		in := inLabel || (n.Type == html.ElementNode && n.Data == "label")
		for c := n.FirstChild; c != nil; c = c.NextSibling {
			walk(c, in, f)
		}
	}
	walk(doc, false, func(n *html.Node, _ bool) {
		if n.Type == html.ElementNode && n.Data == "label" {
			if id, ok := attr(n, "for"); ok {
				labelled[id] = true
			}
		}
	})
	var out []string
	walk(doc, false, func(n *html.Node, inLabel bool) {
		if n.Type != html.ElementNode {
			return
		}
		switch n.Data {
		case "input", "select", "textarea":
			if typ, _ := attr(n, "type"); typ == "hidden" {
				return
			}
			id, _ := attr(n, "id")
			if label, _ := attr(n, "aria-label"); label == "" && !inLabel && !labelled[id] {
				name, _ := attr(n, "name")
				out = append(out, fmt.Sprintf("<%s name=%q> has no label", n.Data, name))
			}
		case "button":
			if n.FirstChild == nil {
				if label, _ := attr(n, "aria-label"); label == "" {
					out = append(out, "a button has no text")
				}
			}
		case "th":
			if _, ok := attr(n, "scope"); !ok {
				out = append(out, "a table header has no scope")
			}
		}
	})
	return out
}

// Text colours meet WCAG AA (4.5:1) on every background the stylesheet
// puts them on.
func TestColoursMeetAAContrast(t *testing.T) {
	css, err := os.ReadFile("templates/layout.html")
	require.NoError(t, err)
	colour := func(selector, prop string) string {
		m := regexp.MustCompile(regexp.QuoteMeta(selector) + `\{[^}]*?\b` + prop + `:(#[0-9a-f]{3,6})`).FindSubmatch(css)
		require.NotNil(t, m, "%s %s in the stylesheet", selector, prop)
		return string(m[1])
	}
	page, th := colour("body", "background"), colour("th", "background")
	for _, fg := range []string{colour("body", "color"), colour(".muted", "color"), colour(".bad", "color"), colour(".ok", "color")} {
		for _, bg := range []string{"#fff", page, th} {
			require.GreaterOrEqual(t, contrast(fg, bg), 4.5, "%s on %s", fg, bg)
		}
	}
	header := colour("header", "background")
	require.GreaterOrEqual(t, contrast(colour("header a", "color"), header), 4.5)
}

func contrast(a, b string) float64 {
	la, lb := luminance(a), luminance(b)
	return (math.Max(la, lb) + 0.05) / (math.Min(la, lb) + 0.05)
}

func luminance(hex string) float64 {
	hex = strings.TrimPrefix(hex, "#")
	if len(hex) == 3 {
		hex = string([]byte{hex[0], hex[0], hex[1], hex[1], hex[2], hex[2]})
	}
	var ch [3]float64
	for i := range ch {
		v, _ := strconv.ParseUint(hex[2*i:2*i+2], 16, 8)
		c := float64(v) / 255
		if c <= 0.03928 {
			ch[i] = c / 12.92
		} else {
			ch[i] = math.Pow((c+0.055)/1.055, 2.4)
		}
	}
	return 0.2126*ch[0] + 0.7152*ch[1] + 0.0722*ch[2]
}
