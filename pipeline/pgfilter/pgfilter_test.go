package pgfilter_test

import (
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgfilter"
)

// A filter's text is canonical: two filters never share it (it is what a
// confirmation signs and the audit log records), and Parse reads it back.
func TestFilterTextIsInjectiveAndParsesBack(t *testing.T) {
	at := time.Date(2026, 12, 3, 10, 0, 0, 123, time.UTC)
	filters := []pgfilter.Filter{
		{},
		{AggregateID: "A,text=T"},
		{AggregateID: "A", Text: "T"},
		{AggregateID: "A%2Ctext%3DT"},
		{Text: "100% full"},
		{Text: "line\nbreak", Handler: "h"},
		{CorrelationID: "c-1"},
		{MessageID: "m=1"},
		{Topic: "t", Handler: "h", AggregateID: "a", Text: "x", Fingerprint: "f", CorrelationID: "c", MessageID: "m", Since: at, Until: at.Add(time.Hour)},
	}
	seen := map[string]pgfilter.Filter{}
	for _, f := range filters {
		text := f.String()
		if other, dup := seen[text]; dup {
			t.Fatalf("%+v and %+v share the text %q", f, other, text)
		}
		seen[text] = f
		back, err := pgfilter.Parse(text)
		require.NoError(t, err, text)
		require.True(t, back.Since.Equal(f.Since) && back.Until.Equal(f.Until), text)
		back.Since, back.Until = f.Since, f.Until
		require.Equal(t, f, back, text)
	}
	require.Equal(t, "aggregate=A%2Ctext%3DT", pgfilter.Filter{AggregateID: "A,text=T"}.String())
	require.Equal(t, "aggregate=A,text=T", pgfilter.Filter{AggregateID: "A", Text: "T"}.String())
}

// The command line and the console read the same keys; a relative time
// is resolved once, when read; a key given twice or unknown is refused.
func TestFiltersReadTheSameKeysEverywhere(t *testing.T) {
	f, err := pgfilter.Parse("handler=h,correlation=c-7,message=m-1,since=24h,text=100% full")
	require.NoError(t, err)
	require.Equal(t, "h", f.Handler)
	require.Equal(t, "c-7", f.CorrelationID)
	require.Equal(t, "m-1", f.MessageID)
	require.Equal(t, "100% full", f.Text)
	require.WithinDuration(t, time.Now().Add(-24*time.Hour), f.Since, time.Minute)
	require.True(t, f.Narrows())
	require.True(t, pgfilter.Filter{CorrelationID: "c"}.Narrows(), "a correlation id alone narrows")
	require.True(t, pgfilter.Filter{MessageID: "m"}.Narrows(), "a message id alone narrows")
	require.False(t, pgfilter.Filter{}.Narrows())

	g, err := pgfilter.FromValues(url.Values{"handler": {"h"}, "correlation": {"c-7"}, "message": {"m-1"}, "q": {"100% full"}})
	require.NoError(t, err)
	g.Since = f.Since
	require.Equal(t, f, g, "the console's form and the command line's --filter are one grammar")
	h, err := pgfilter.FromValues(url.Values{"text": {"x"}})
	require.NoError(t, err)
	require.Equal(t, "x", h.Text)

	for _, bad := range []string{"handler=a,handler=b", "nope=1", "since=yesterday", "handler"} {
		_, err := pgfilter.Parse(bad)
		require.Error(t, err, bad)
	}
	_, err = pgfilter.FromValues(url.Values{"handler": {"a", "b"}})
	require.Error(t, err)
}
