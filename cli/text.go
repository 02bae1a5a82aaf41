package cli

import (
	"strings"

	"github.com/ferry-dev/ferry/internal/display"
)

// Widths of table cells; JSON output is never cut or escaped beyond JSON's
// own rules.
const (
	maxIDCell     = 40
	maxTextCell   = 80
	maxReasonCell = 100
)

// cell makes s safe and readable in a table on a terminal (display.Cell):
// control, bidi and format characters escaped, white space folded, cut to
// max runes with "…".
func cell(s string, max int) string { return display.Cell(s, max) }

// escapeText escapes what cell escapes but keeps the text whole, and its
// line breaks (indented) when keepLines is set, for pretty-printed payloads.
func escapeText(s string, keepLines bool) string {
	out := display.Escape(s, 0, keepLines)
	if keepLines {
		out = strings.ReplaceAll(out, "\n", "\n  ")
	}
	return out
}
