package cli

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Widths of table cells; JSON output is never cut or escaped beyond JSON's
// own rules.
const (
	maxIDCell     = 40
	maxTextCell   = 80
	maxReasonCell = 100
)

// cell makes s safe and readable in a table on a terminal: control
// characters (ESC, CR, C1 controls), bidirectional overrides and other
// format characters that reorder or hide text (U+202E) are shown escaped
// (\x1b, \u202e), runs of white space become one space, invalid UTF-8 shows
// as \xNN, and the result is cut to at most max runes with "…".
func cell(s string, max int) string {
	var b strings.Builder
	n := 0
	space := false
	for i := 0; i < len(s) && n < max; {
		r, size := utf8.DecodeRuneInString(s[i:])
		var piece string
		switch {
		case r == utf8.RuneError && size == 1:
			piece = fmt.Sprintf(`\x%02x`, s[i])
		case r == ' ' || r == '\t' || r == '\n' || r == '\r':
			if !space && b.Len() > 0 {
				piece = " "
			}
			space = true
		case unicode.IsControl(r) || unicode.Is(unicode.Cf, r) || r == '\u2028' || r == '\u2029':
			if r < 0x100 {
				piece = fmt.Sprintf(`\x%02x`, r)
			} else {
				piece = fmt.Sprintf(`\u%04x`, r)
			}
		default:
			piece = string(r)
		}
		if r != ' ' && r != '\t' && r != '\n' && r != '\r' {
			space = false
		}
		i += size
		if piece == "" {
			continue
		}
		b.WriteString(piece)
		n += utf8.RuneCountInString(piece)
		if n >= max && i < len(s) {
			return truncateRunes(b.String(), max-1) + "…"
		}
	}
	return strings.TrimRight(b.String(), " ")
}

func truncateRunes(s string, n int) string {
	if n <= 0 {
		return ""
	}
	i := 0
	for j := range s {
		if i == n {
			return s[:j]
		}
		i++
	}
	return s
}

// escapeText escapes what cell escapes but keeps the text whole, and its
// line breaks when keepLines is set (for pretty-printed payloads).
func escapeText(s string, keepLines bool) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\n' && keepLines:
			b.WriteString("\n  ")
		case r == '\t' || r == ' ':
			b.WriteRune(r)
		case unicode.IsControl(r) || unicode.Is(unicode.Cf, r) || r == '\u2028' || r == '\u2029':
			if r < 0x100 {
				fmt.Fprintf(&b, `\x%02x`, r)
			} else {
				fmt.Fprintf(&b, `\u%04x`, r)
			}
		default:
			b.WriteRune(r)
		}
		i += size
	}
	return b.String()
}
