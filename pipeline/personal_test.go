package pipeline_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline"
)

// One redaction for every error text Ferry stores or shows: the address
// forms a plain pattern misses (quoted local parts, address literals),
// phone numbers in their usual forms, card and account numbers; and what
// an operator needs from the same text (status codes, SMTP's enhanced
// codes, times, hosts and ports, short ids) stays.
func TestRedactPersonal(t *testing.T) {
	t.Parallel()
	for _, pii := range []string{
		"dave@example.com", `"Dave Smith"@example.com`, `"dave\"q"@example.com`, "dave@[10.0.0.1]", "dave@[IPv6:2001:db8::1]",
		"dave.o'neil+tag@sub.example.co.uk",
		"+1 (555) 123-4567", "+44 20 7946 0958", "+81-3-1234-5678", "(555) 123-4567", "555-123-4567", "555.123.4567", "5551234567",
		"4242424242424242", "4242 4242 4242 4242", "4242-4242-4242-4242", "DE89 3704 0044 0532 0130 00",
	} {
		text := "550 5.1.1 refused for " + pii + " at 2026-12-04T10:00:00Z (order 1234, host 10.0.0.1:25)"
		got := pipeline.RedactPersonal(text)
		require.NotContains(t, got, pii, "%q -> %q", pii, got)
		for _, kept := range []string{"550 5.1.1 refused for", "2026-12-04T10:00:00Z", "order 1234", "10.0.0.1:25"} {
			require.Contains(t, got, kept, "%q -> %q", pii, got)
		}
	}
	for _, clean := range []string{"payment provider answered 402 (card_declined)", "gave up after 5 attempts", "451 4.7.1 try again later",
		"dial tcp 127.0.0.1:5432: connection refused", "timeout after 30s", "version 1.2.3"} {
		require.Equal(t, clean, pipeline.RedactPersonal(clean))
	}
	// Ids stay whole, all-digit stretches of a UUID included.
	for _, id := range []string{"83920417-5521-4abc-9def-123456789012", "3b2f1c5e-aa81-46f1-9a61-ad7f4dd09bfd", "order-1234567890123"} {
		text := "charging " + id + ": provider answered 503"
		require.Equal(t, text, pipeline.RedactPersonal(text))
	}
	require.Equal(t, "card acct_<number> refused", pipeline.RedactPersonal("card acct_4242424242424242 refused"))
	require.Equal(t, "cards <number>, <number>", pipeline.RedactPersonal("cards 4242424242424242, 5555555555554444"))
	// What still reached the poison store: a reply quoted by the SMTP
	// client (%q escapes the local part's quotes), cards written with dots
	// or joined to a word, a phone with dots.
	for _, tc := range []struct{ in, pii string }{
		{`mailing order 1: SMTP RCPT TO: "550 5.1.1 <\"Dave Smith\"@example.com>: mailbox unavailable"`, "Dave Smith"},
		{"card 4111.1111.1111.1111 declined", "4111"},
		{"provider said ref-4111111111111111 is invalid", "4111"},
		{"payment provider answered 402 (card-4111-1111-1111-1111)", "4111"},
		{"token tok4111111111111111x", "4111"},
		{"call 07946.095.812 back", "095"},
	} {
		got := pipeline.RedactPersonal(tc.in)
		require.NotContains(t, got, tc.pii, "%q -> %q", tc.in, got)
	}
	// An address and a UUID with long digit runs stay whole.
	for _, clean := range []string{"dial tcp 192.168.100.200:5672: i/o timeout", "message 83920417-5521-4a1b-9f3e-1234567890ab failed"} {
		require.Equal(t, clean, pipeline.RedactPersonal(clean))
	}
	long := strings.Repeat("x", 5000) + " dave@example.com"
	require.Equal(t, 300, len(pipeline.ErrorText(errors.New(long), 300)))
	require.Equal(t, "to <redacted>: 550", pipeline.ErrorText(errors.New("to \"Dave Smith\"@example.com: 550"), 300))
}

// A reason's group: one cause, one label, whatever ids and numbers it
// carries; another cause, another label; bounded and redacted.
func TestReasonGroup(t *testing.T) {
	t.Parallel()
	a := pipeline.ReasonGroup(errors.New("charging order 17: payment provider answered 503 (request 83920417-5521-4a1b-9f3e-1234567890ab)"))
	b := pipeline.ReasonGroup(errors.New("charging order 9021: payment provider answered 503 (request 3b2f1c5e-aa81-46f1-9a61-ad7f4dd09bfd)"))
	c := pipeline.ReasonGroup(errors.New("charging order 17: payment provider answered 402 (card_declined)"))
	require.Equal(t, a, b)
	require.NotEqual(t, a, c)
	require.Equal(t, "charging order #: payment provider answered # (request <id>)", a)
	require.NotContains(t, pipeline.ReasonGroup(errors.New("mail to dave@example.com refused")), "dave")
	require.LessOrEqual(t, len(pipeline.ReasonGroup(errors.New(strings.Repeat("x", 500)))), 60)
	require.Empty(t, pipeline.ReasonGroup(nil))
}
