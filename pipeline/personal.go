package pipeline

import (
	"regexp"
	"strings"
)

// Written here because no library of this stack masks personal data in free
// text; the patterns err on the side of masking, since what they meet is an
// error's text on its way to logs, retry headers, the poison store and an
// agent's intent_status.
var (
	// A mail address (RFC 5322 addr-spec): a dot-atom or quoted local part
	// ("Dave Smith"@example.com), then a domain or an address literal
	// (dave@[10.0.0.1], dave@[IPv6:2001:db8::1]).
	mailAddress = regexp.MustCompile(`(?:"(?:[^"\\\r\n]|\\.)*"|[^\s<>@"',;:()\[\]]+)@(?:\[[^\]\s]*\]|[^\s<>@"',;:()\[\]]+)`)
	// Phone numbers: international (+44 20 7946 0958, +1-555-123-4567), an
	// area code in parentheses ((555) 123-4567), the North American
	// 555-123-4567 / 555.123.4567 forms.
	phoneNumber = regexp.MustCompile(`\+\d[\d ().-]{5,}\d|\(\d{1,4}\)[ .-]?\d{2,4}(?:[ .-]?\d{2,5}){1,2}|\b\d{3}[.-]\d{3}[.-]\d{4}\b`)
	// Card, account (an IBAN with its country) and plain phone numbers:
	// ten digits or more, spaces or dashes between them allowed.
	longNumber = regexp.MustCompile(`(?:[A-Z]{2})?\d(?:[ -]?\d){9,}`)
)

// RedactPersonal masks the personal data an error text may quote from a
// provider or a client: mail addresses become <redacted>, phone, card and
// account numbers <number>. Ferry applies it to every handler error it
// stores or shows (retry headers, the poison store's reason, logs,
// intent_status); a handler should still keep such data out of its errors
// in the first place.
func RedactPersonal(s string) string {
	s = mailAddress.ReplaceAllString(s, "<redacted>")
	s = replaceBounded(phoneNumber, s, "<number>")
	return replaceBounded(longNumber, s, "<number>")
}

// replaceBounded replaces the matches of re that stand alone: not inside
// a longer token of letters, digits and dashes, such as a message's UUID
// (83920417-5521-4…), which stays whole (ids are what an operator needs,
// and a cut one no longer groups with its kind).
func replaceBounded(re *regexp.Regexp, s, repl string) string {
	var b strings.Builder
	last := 0
	for _, m := range re.FindAllStringIndex(s, -1) {
		if (m[0] > 0 && tokenByte(s[m[0]-1])) || (m[1] < len(s) && tokenByte(s[m[1]])) {
			continue
		}
		b.WriteString(s[last:m[0]])
		b.WriteString(repl)
		last = m[1]
	}
	if last == 0 {
		return s
	}
	b.WriteString(s[last:])
	return b.String()
}

func tokenByte(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '-'
}

// ErrorText is how Ferry stores and logs a handler's error: RedactText
// of its text.
func ErrorText(err error, max int) string {
	if err == nil {
		return ""
	}
	return RedactText(err.Error(), max)
}

// RedactText is s with its personal data masked (RedactPersonal), made
// storable and cut to max bytes (CleanText; max <= 0: no cut).
func RedactText(s string, max int) string {
	if max > 0 {
		s = CleanText(s, 4*max) // a bound on the patterns' work first
	}
	return CleanText(RedactPersonal(s), max)
}
