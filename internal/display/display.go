// Package display makes untrusted text (reasons, ids, payloads from
// messages anyone may have published) safe to show on a terminal or a web
// page: control characters that move the cursor or clear the screen, bidi
// overrides and zero-width characters that reorder or hide text, and
// invalid UTF-8 are shown as escapes, and the text is cut to a width. The
// CLI's tables and the console's pages use the same rule. (HTML escaping
// is html/template's job; this is about what survives it.)
package display

import (
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// Escape returns s with every control character (C0, C1, DEL), format
// character (U+202E, U+200B, …), line or paragraph separator and invalid
// UTF-8 byte written as an escape (\x1b, \u202e, \xff). With keepLines,
// \n and \t stay as they are. With max > 0 the result has at most max
// runes, escapes counted, the last one "…" when s was cut; an escape is
// never cut in two.
func Escape(s string, max int, keepLines bool) string {
	var pieces []string
	total := 0
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		var p string
		switch {
		case r == utf8.RuneError && size == 1:
			p = fmt.Sprintf(`\x%02x`, s[i])
		case keepLines && (r == '\n' || r == '\t'):
			p = string(r)
		case unicode.IsControl(r) || unicode.Is(unicode.Cf, r) || r == '\u2028' || r == '\u2029':
			if r < 0x100 {
				p = fmt.Sprintf(`\x%02x`, r)
			} else {
				p = fmt.Sprintf(`\u%04x`, r)
			}
		default:
			p = string(r)
		}
		i += size
		pieces = append(pieces, p)
		total += utf8.RuneCountInString(p)
		if max > 0 && total > max+8 {
			break // enough to know it is cut
		}
	}
	if max <= 0 || total <= max {
		return strings.Join(pieces, "")
	}
	var b strings.Builder
	n := 0
	for _, p := range pieces {
		w := utf8.RuneCountInString(p)
		if n+w > max-1 {
			break
		}
		b.WriteString(p)
		n += w
	}
	b.WriteString("…")
	return b.String()
}

// Cell is Escape for a table cell: runs of white space (line breaks
// included) become one space, and the ends are trimmed.
func Cell(s string, max int) string {
	return Escape(strings.Join(strings.Fields(s), " "), max, false)
}

// Age says how long d is the way a person reads it: "45s", "5m 3s",
// "3h 12m", "6d 22h", at most two units, rounded down ("166h36m12s" is
// "6d 22h"). A negative d is "0s".
func Age(d time.Duration) string {
	if d < time.Second {
		return "0s"
	}
	s := int64(d / time.Second)
	days, hours, mins, secs := s/86400, s%86400/3600, s%3600/60, s%60
	switch {
	case days > 0:
		return fmt.Sprintf("%dd %dh", days, hours)
	case hours > 0:
		return fmt.Sprintf("%dh %dm", hours, mins)
	case mins > 0:
		return fmt.Sprintf("%dm %ds", mins, secs)
	}
	return fmt.Sprintf("%ds", secs)
}
