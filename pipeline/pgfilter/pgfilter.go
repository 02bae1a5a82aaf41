// Package pgfilter turns an operator's filter (topic, handler, aggregate,
// text, error group, correlation, message, time) into a SQL condition over
// one of Ferry's tables: the poison store and the outbox's failing rows are
// filtered by the same words, in the console and on the command line.
package pgfilter

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// MaxLimit bounds Filter.Limit (and the poison store's Selector.Limit).
const MaxLimit = 10_000_000

// Filter chooses rows to read, oldest first: poisoned messages, or the
// outbox rows the relay keeps failing to publish. Every field set narrows
// the choice.
type Filter struct {
	// Topic keeps the messages of one original topic ("" for all).
	Topic string
	// Handler keeps the messages one route gave up on.
	Handler string
	// AggregateID keeps one aggregate's messages.
	AggregateID string
	// Text keeps messages whose reason contains it (case-insensitive).
	Text string
	// Fingerprint keeps one group: the reason with ids, numbers and
	// addresses normalised away (ferry_fingerprint, migration 00013).
	Fingerprint string
	// CorrelationID keeps the messages of one request's chain.
	CorrelationID string
	// MessageID keeps one message (all its poisonings).
	MessageID string
	// Tenant keeps one tenant's messages (their tenant_id header): in a
	// tenant fleet, an action scoped to one tenant.
	Tenant string
	// Since and Until bound the time the messages were poisoned.
	Since, Until time.Time
	// AfterID starts after this poison id.
	AfterID int64
	// Limit caps how many are read; 0 means all.
	Limit int
}

// Keys are the filter's keys, in the one order its text uses: the same
// words in the console's forms and links, on the command line (--filter)
// and in the audit log.
var Keys = []string{"topic", "handler", "aggregate", "text", "fingerprint", "correlation", "message", "tenant", "since", "until"}

// String is the filter's canonical text: its criteria as key=value,
// comma-separated, in Keys' order, with "%", "," and "=" (and control
// characters) in a value escaped as %XX, so that two different filters
// never share a text: what a confirmation is signed for and what the
// audit log records is this text. (Without escaping, aggregate "A,text=T"
// and aggregate A with text T were one text.) Parse reads it back.
func (f Filter) String() string {
	var parts []string
	for _, kv := range f.pairs() {
		parts = append(parts, kv[0]+"="+escape(kv[1]))
	}
	if len(parts) == 0 {
		return "all"
	}
	return strings.Join(parts, ",")
}

// Values is the filter's criteria by key (Keys), unescaped, with since
// and until as absolute times: a form that carries them back (a
// confirmation's) means the same filter, not "24h before the click".
func (f Filter) Values() map[string][]string {
	out := map[string][]string{}
	for _, kv := range f.pairs() {
		out[kv[0]] = []string{kv[1]}
	}
	return out
}

func (f Filter) pairs() [][2]string {
	var out [][2]string
	for _, kv := range [][2]string{{"topic", f.Topic}, {"handler", f.Handler}, {"aggregate", f.AggregateID}, {"text", f.Text}, {"fingerprint", f.Fingerprint},
		{"correlation", f.CorrelationID}, {"message", f.MessageID}, {"tenant", f.Tenant}} {
		if kv[1] != "" {
			out = append(out, kv)
		}
	}
	if !f.Since.IsZero() {
		out = append(out, [2]string{"since", f.Since.UTC().Format(time.RFC3339Nano)})
	}
	if !f.Until.IsZero() {
		out = append(out, [2]string{"until", f.Until.UTC().Format(time.RFC3339Nano)})
	}
	return out
}

func escape(v string) string {
	var b strings.Builder
	for i := 0; i < len(v); i++ {
		switch c := v[i]; {
		case c == '%' || c == ',' || c == '=' || c < 0x20 || c == 0x7f:
			fmt.Fprintf(&b, "%%%02X", c)
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}

// Parse reads a filter's text: key=value pairs, comma-separated, values
// %XX-escaped as String writes them (a value without "%", "," or "=" is
// written as it is). since and until take a duration back from now (24h)
// or a time (RFC 3339, or 2006-01-02T15:04 in UTC): a duration is resolved
// here, once, so that what was counted is what is acted on. "all" or ""
// is no criterion.
func Parse(text string) (Filter, error) {
	var f Filter
	if text = strings.TrimSpace(text); text == "all" {
		return f, nil
	}
	seen := map[string]bool{}
	for _, part := range strings.Split(text, ",") {
		if part = strings.TrimSpace(part); part == "" {
			continue
		}
		k, raw, ok := strings.Cut(part, "=")
		if !ok {
			return Filter{}, fmt.Errorf("want key=value, got %q", part)
		}
		v := unescape(raw)
		if seen[k] {
			return Filter{}, fmt.Errorf("%s given twice", k)
		}
		seen[k] = true
		if err := f.set(k, v); err != nil {
			return Filter{}, err
		}
	}
	return f, nil
}

// unescape decodes %XX; a "%" not followed by two hex digits stays as it
// is, so that a hand-written "text=100% full" means what it says.
func unescape(v string) string {
	if !strings.Contains(v, "%") {
		return v
	}
	var b strings.Builder
	for i := 0; i < len(v); i++ {
		if v[i] == '%' && i+2 < len(v) {
			if n, err := strconv.ParseUint(v[i+1:i+3], 16, 8); err == nil {
				b.WriteByte(byte(n))
				i += 2
				continue
			}
		}
		b.WriteByte(v[i])
	}
	return b.String()
}

// FromValues reads a filter from a query or a form, with Keys as its keys
// ("q" is read as "text", the console's search box). A key given twice is
// refused: which one would the action use?
func FromValues(v map[string][]string) (Filter, error) {
	var f Filter
	var errs []error
	for _, k := range append([]string{"q"}, Keys...) {
		vals := v[k]
		if len(vals) > 1 {
			errs = append(errs, fmt.Errorf("%s given more than once", k))
			continue
		}
		if len(vals) == 0 || vals[0] == "" {
			continue
		}
		key := k
		if k == "q" {
			key = "text"
		}
		if err := f.set(key, vals[0]); err != nil {
			errs = append(errs, err)
		}
	}
	return f, errors.Join(errs...)
}

func (f *Filter) set(k, v string) error {
	switch k {
	case "topic":
		f.Topic = v
	case "handler":
		f.Handler = v
	case "aggregate":
		f.AggregateID = v
	case "text":
		f.Text = v
	case "fingerprint":
		f.Fingerprint = v
	case "correlation":
		f.CorrelationID = v
	case "message":
		f.MessageID = v
	case "tenant":
		f.Tenant = v
	case "since", "until":
		t, err := TimeOrAgo(v, time.Now())
		if err != nil {
			return fmt.Errorf("%s: %w", k, err)
		}
		if k == "since" {
			f.Since = t
		} else {
			f.Until = t
		}
	default:
		return fmt.Errorf("unknown key %q (%s)", k, strings.Join(Keys, ", "))
	}
	return nil
}

// TimeOrAgo reads a duration back from now (24h) or a time (RFC 3339, or
// 2006-01-02T15:04 in UTC, as a browser's datetime-local field sends it).
func TimeOrAgo(v string, now time.Time) (time.Time, error) {
	if d, err := time.ParseDuration(v); err == nil && d > 0 {
		return now.Add(-d), nil
	}
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		return t, nil
	}
	if t, err := time.Parse("2006-01-02T15:04", v); err == nil {
		return t, nil
	}
	return time.Time{}, errors.New("want a duration back from now (24h) or a time (2026-12-03T10:00 or RFC 3339)")
}

// Narrows reports whether f selects anything narrower than everything.
func (f Filter) Narrows() bool {
	return len(f.pairs()) > 0
}

// Columns name what a Filter's criteria compare in a table: an empty name
// leaves that criterion out (the outbox has no handler).
type Columns struct {
	Topic, Handler, AggregateID, Text, Fingerprint, Time, CorrelationID, MessageID, Tenant string
}

// SQL is f's criteria as a SQL condition over a table with the columns
// c, its arguments numbered from $first. Only column names and placeholders
// are written into the SQL; every value is an argument.
func (f Filter) SQL(first int, c Columns) (string, []any) {
	conds := []string{"true"}
	var args []any
	add := func(col, op string, v any) {
		if col == "" {
			return
		}
		args = append(args, v)
		p := "$" + strconv.Itoa(first+len(args)-1)
		conds = append(conds, strings.NewReplacer("{c}", col, "{p}", p).Replace(op))
	}
	if f.Topic != "" {
		add(c.Topic, "{c} = {p}", f.Topic)
	}
	if f.Handler != "" {
		add(c.Handler, "{c} = {p}", f.Handler)
	}
	if f.AggregateID != "" {
		add(c.AggregateID, "{c} = {p}", f.AggregateID)
	}
	if f.Text != "" {
		add(c.Text, "strpos(lower({c}), lower({p})) > 0", f.Text)
	}
	if f.Fingerprint != "" {
		add(c.Fingerprint, "{c} = {p}", f.Fingerprint)
	}
	if f.CorrelationID != "" {
		add(c.CorrelationID, "{c} = {p}", f.CorrelationID)
	}
	if f.MessageID != "" {
		add(c.MessageID, "{c} = {p}", f.MessageID)
	}
	if f.Tenant != "" {
		add(c.Tenant, "{c} = {p}", f.Tenant)
	}
	if !f.Since.IsZero() {
		add(c.Time, "{c} >= {p}", f.Since)
	}
	if !f.Until.IsZero() {
		add(c.Time, "{c} < {p}", f.Until)
	}
	return strings.Join(conds, " AND "), args
}

// Validate rejects out-of-range paging.
func (f Filter) Validate() error {
	var errs []error
	if f.Limit < 0 || f.Limit > MaxLimit {
		errs = append(errs, fmt.Errorf("limit must be in [0, %d] (0: no cap), got %d", MaxLimit, f.Limit))
	}
	if f.AfterID < 0 {
		errs = append(errs, fmt.Errorf("after-id must not be negative, got %d", f.AfterID))
	}
	return errors.Join(errs...)
}
