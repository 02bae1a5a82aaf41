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
	// Since and Until bound the time the messages were poisoned.
	Since, Until time.Time
	// AfterID starts after this poison id.
	AfterID int64
	// Limit caps how many are read; 0 means all.
	Limit int
}

// String is the filter's criteria, for messages and the audit log.
func (f Filter) String() string {
	var parts []string
	for _, kv := range [][2]string{{"topic", f.Topic}, {"handler", f.Handler}, {"aggregate", f.AggregateID}, {"text", f.Text}, {"fingerprint", f.Fingerprint},
		{"correlation", f.CorrelationID}, {"message", f.MessageID}} {
		if kv[1] != "" {
			parts = append(parts, kv[0]+"="+kv[1])
		}
	}
	if !f.Since.IsZero() {
		parts = append(parts, "since="+f.Since.UTC().Format(time.RFC3339))
	}
	if !f.Until.IsZero() {
		parts = append(parts, "until="+f.Until.UTC().Format(time.RFC3339))
	}
	if len(parts) == 0 {
		return "all"
	}
	return strings.Join(parts, ",")
}

// Narrows reports whether f selects anything narrower than everything.
func (f Filter) Narrows() bool {
	return f.Topic != "" || f.Handler != "" || f.AggregateID != "" || f.Text != "" || f.Fingerprint != "" || !f.Since.IsZero() || !f.Until.IsZero()
}

// Columns name what a Filter's criteria compare in a table: an empty name
// leaves that criterion out (the outbox has no handler).
type Columns struct {
	Topic, Handler, AggregateID, Text, Fingerprint, Time, CorrelationID, MessageID string
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
