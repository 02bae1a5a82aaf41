// Package pgconfirm keeps what an operator was shown before an action
// (ferry_confirmations, migration 00028): the exact ids a preview counted,
// under a single-use nonce, until the confirmation expires.
//
// A confirmation that bound only "the newest id and how many" let the
// action take rows nobody saw: an older row that joined the selection
// after the preview (it failed with the same error), or messages an Undo
// put back under their old, lower ids. Keeping the ids themselves makes
// the action act on the set shown and nothing else, and lets it say how
// many of them were gone by the time of the click. The ids live in the
// database, not in the form, so that a preview of 250,000 messages costs
// the browser nothing and any console process can take the click.
package pgconfirm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Table is the confirmations table.
const Table = "ferry_confirmations"

// DefaultTTL is how long a confirmation can be used: minutes, so that a
// page left open over lunch cannot act on a set that has long changed.
const DefaultTTL = 10 * time.Minute

// ErrExpired is returned by Load for a confirmation past its expiry.
var ErrExpired = errors.New("this confirmation has expired: look at the selection again and confirm what it holds now")

// ErrUnknown is returned by Load for a nonce no preview recorded (or one
// removed long after it expired).
var ErrUnknown = errors.New("no such confirmation: look at the selection again")

// Preview is what an operator was shown: the action on a selection and
// the ids it held.
type Preview struct {
	// Kind names the store acted on (poison, failing, retrying).
	Kind string
	// Action is the verb (requeue, discard, retry-now).
	Action string
	// Selection is the selection's canonical text (what the audit log
	// records and the confirmation's signature covers).
	Selection string
	// IDs are the ids shown, oldest first.
	IDs []int64
	// Total is how many the selection held: more than len(IDs) when the
	// preview took only the oldest.
	Total int
	// ExpiresAt is set by Save.
	ExpiresAt time.Time
}

// Execer is a pool, a connection or a transaction.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Save records p for ttl (DefaultTTL when zero) under a new nonce and
// returns it, with p's expiry. Confirmations expired a day ago or more go
// in the same call: the table holds only what can still be used or
// explained.
func Save(ctx context.Context, q Execer, p Preview, ttl time.Duration) (nonce string, expires time.Time, err error) {
	if ttl <= 0 {
		ttl = DefaultTTL
	}
	if p.Kind == "" || p.Action == "" || p.Selection == "" {
		return "", time.Time{}, errors.New("pgconfirm: a preview needs its kind, action and selection")
	}
	if p.IDs == nil {
		p.IDs = []int64{}
	}
	b := make([]byte, 16)
	_, _ = rand.Read(b) // crypto/rand.Read never fails (Go 1.24+)
	nonce = hex.EncodeToString(b)
	err = q.QueryRow(ctx, `WITH old AS (DELETE FROM `+Table+` WHERE expires_at < now() - interval '1 day')
		INSERT INTO `+Table+` (nonce, kind, action, selection, ids, total, expires_at)
		VALUES ($1, $2, $3, $4, $5, $6, now() + $7 * interval '1 microsecond') RETURNING expires_at`,
		nonce, p.Kind, p.Action, p.Selection, p.IDs, p.Total, ttl.Microseconds()).Scan(&expires)
	if err != nil {
		return "", time.Time{}, fmt.Errorf("recording the confirmation: %w", err)
	}
	return nonce, expires, nil
}

// Load returns the preview recorded under nonce: ErrUnknown if there is
// none, ErrExpired past its expiry. It does not use it up: the action's
// audit entry records the nonce, and a second action with it is refused
// there (pgaudit.ErrConfirmationUsed), in the action's own transaction.
func Load(ctx context.Context, q Execer, nonce string) (Preview, error) {
	var p Preview
	var expired bool
	err := q.QueryRow(ctx, `SELECT kind, action, selection, ids, total, expires_at, expires_at <= now() FROM `+Table+` WHERE nonce = $1`, nonce).
		Scan(&p.Kind, &p.Action, &p.Selection, &p.IDs, &p.Total, &p.ExpiresAt, &expired)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return Preview{}, ErrUnknown
	case err != nil:
		return Preview{}, fmt.Errorf("reading the confirmation: %w", err)
	case expired:
		return Preview{}, ErrExpired
	}
	return p, nil
}
