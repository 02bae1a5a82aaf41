package pipeline

import (
	"regexp"
	"slices"
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
	// The same with its quotes escaped, as an error that quoted the reply
	// writes it (fmt's %q, Go's SMTP errors): \"Dave Smith\"@example.com.
	escapedMail = regexp.MustCompile(`\\"(?:[^"\\\r\n]|\\[^"])*\\"@(?:\[[^\]\s]*\]|[^\s<>@"',;:()\[\]\\]+)`)
	// Phone numbers: international (+44 20 7946 0958, +1-555-123-4567), an
	// area code in parentheses ((555) 123-4567), the North American
	// 555-123-4567 / 555.123.4567 forms.
	phoneNumber = regexp.MustCompile(`\+\d[\d ().-]{5,}\d|\(\d{1,4}\)[ .-]?\d{2,4}(?:[ .-]?\d{2,5}){1,2}|\b\d{3}[.-]\d{3}[.-]\d{4}\b`)
	// Card, account (an IBAN with its country) and plain phone numbers:
	// ten digits or more, one space, dot or dash between them allowed
	// (4111.1111.1111.1111, 07946.095.812). Standing alone, any such number
	// is masked; joined to letters or dashes (ref-4111111111111111,
	// card-4111-1111-1111-1111), a card number is (13 to 19 digits passing
	// the Luhn check), while an id like order-1234567890123 mostly stays.
	longNumber = regexp.MustCompile(`(?:[A-Z]{2})?\d(?:[ .-]?\d){9,}`)
	// Tokens that hold long digit runs but are not personal: a UUID (a
	// message id, whole, is what an operator needs) and an IPv4 address.
	uuidToken = regexp.MustCompile(`(?i)\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b`)
	ipv4Token = regexp.MustCompile(`\b\d{1,3}(?:\.\d{1,3}){3}\b`)
)

// RedactPersonal masks the personal data an error text may quote from a
// provider or a client: mail addresses become <redacted>, phone, card and
// account numbers <number>. Ferry applies it to every handler error it
// stores or shows (retry headers, the poison store's reason, logs,
// intent_status); a handler should still keep such data out of its errors
// in the first place.
func RedactPersonal(s string) string {
	s = escapedMail.ReplaceAllString(s, "<redacted>")
	s = mailAddress.ReplaceAllString(s, "<redacted>")
	s = replaceBounded(phoneNumber, s, "<number>")
	return replaceOutside(longNumber, s, "<number>", uuidToken, ipv4Token)
}

// luhn reports whether the digits of s (other bytes skipped) are 13 to 19
// and pass the Luhn check, as every card number does.
func luhn(s string) bool {
	var digits []int
	for i := 0; i < len(s); i++ {
		if c := s[i]; c >= '0' && c <= '9' {
			digits = append(digits, int(c-'0'))
		}
	}
	if len(digits) < 13 || len(digits) > 19 {
		return false
	}
	sum := 0
	for i := range digits {
		d := digits[len(digits)-1-i]
		if i%2 == 1 {
			if d *= 2; d > 9 {
				d -= 9
			}
		}
		sum += d
	}
	return sum%10 == 0
}

// replaceOutside replaces the matches of re that overlap none of keep's
// matches (a UUID, an IP address), which stay whole, and that stand alone
// or, joined to a longer token, are card numbers (luhn).
func replaceOutside(re *regexp.Regexp, s, repl string, keep ...*regexp.Regexp) string {
	var kept [][]int
	for _, k := range keep {
		kept = append(kept, k.FindAllStringIndex(s, -1)...)
	}
	return replaceWhere(re, s, repl, func(m []int) bool {
		if slices.ContainsFunc(kept, func(k []int) bool { return m[0] < k[1] && k[0] < m[1] }) {
			return false
		}
		return !joined(s, m) || luhn(s[m[0]:m[1]])
	})
}

// replaceBounded replaces the matches of re that stand alone: not inside
// a longer token of letters, digits and dashes, such as a message's UUID
// (83920417-5521-4…), which stays whole (ids are what an operator needs,
// and a cut one no longer groups with its kind).
func replaceBounded(re *regexp.Regexp, s, repl string) string {
	return replaceWhere(re, s, repl, func(m []int) bool { return !joined(s, m) })
}

// replaceWhere replaces the matches of re for which replace says so.
func replaceWhere(re *regexp.Regexp, s, repl string, replace func(m []int) bool) string {
	var b strings.Builder
	last := 0
	for _, m := range re.FindAllStringIndex(s, -1) {
		if !replace(m) {
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

// joined says whether match m of s is part of a longer token.
func joined(s string, m []int) bool {
	return (m[0] > 0 && tokenByte(s[m[0]-1])) || (m[1] < len(s) && tokenByte(s[m[1]]))
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

// ReasonGroup is err's reason as a short, bounded label: redacted, its
// ids and numbers normalised away (a UUID becomes <id>, a run of digits
// #), spaces collapsed, at most 60 bytes. Two failures of one cause share
// it, another cause gets its own: a metric labelled by it tells a new
// cause from the one already paging (a card decline arriving while a
// provider's 503s are).
func ReasonGroup(err error) string {
	if err == nil {
		return ""
	}
	s := RedactPersonal(err.Error())
	s = uuidToken.ReplaceAllString(s, "<id>")
	s = digitRun.ReplaceAllString(s, "#")
	s = strings.Join(strings.Fields(s), " ")
	return CleanText(s, 60)
}

var digitRun = regexp.MustCompile(`\d+`)
