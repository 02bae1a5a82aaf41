// Package pgsession owns the console's sessions (ferry_console_sessions,
// migration 00021): kept on the server, so that logging out ends a
// session wherever its cookie was copied, every console process behind a
// load balancer agrees, and each session names who logged in.
package pgsession

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Table is the sessions table.
const Table = "ferry_console_sessions"

// Session is one login.
type Session struct {
	ID        string
	Identity  string
	ExpiresAt time.Time
}

// ErrNone is returned by Get for a session that does not exist (never
// did, ended, or expired).
var ErrNone = errors.New("no such session")

// Start records a session of identity lasting lifetime, and removes the
// expired ones.
func Start(ctx context.Context, pool *pgxpool.Pool, identity string, lifetime time.Duration) (Session, error) {
	b := make([]byte, 16)
	_, _ = rand.Read(b) // crypto/rand.Read never fails (Go 1.24+)
	s := Session{ID: hex.EncodeToString(b), Identity: identity}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `DELETE FROM `+Table+` WHERE expires_at < now()`); err != nil {
			return err
		}
		return tx.QueryRow(ctx, `INSERT INTO `+Table+` (id, identity, expires_at) VALUES ($1, $2, now() + $3 * interval '1 second') RETURNING expires_at`,
			s.ID, identity, lifetime.Seconds()).Scan(&s.ExpiresAt)
	})
	if err != nil {
		return Session{}, fmt.Errorf("starting a console session: %w", err)
	}
	return s, nil
}

// Get returns the live session id, or ErrNone: one that has not expired
// and was used within idle (0: no idle limit). A use is recorded at most
// once a minute, so that reading a page writes nothing most of the time.
func Get(ctx context.Context, pool *pgxpool.Pool, id string, idle time.Duration) (Session, error) {
	s := Session{ID: id}
	if idle <= 0 {
		idle = SessionMaxIdle
	}
	err := pool.QueryRow(ctx, `WITH s AS (
			SELECT identity, expires_at FROM `+Table+`
			WHERE id = $1 AND expires_at > now() AND last_seen_at > now() - $2 * interval '1 microsecond'),
		touch AS (
			UPDATE `+Table+` SET last_seen_at = now()
			WHERE id = $1 AND last_seen_at < now() - interval '1 minute' AND EXISTS (SELECT 1 FROM s))
		SELECT identity, expires_at FROM s`, id, idle.Microseconds()).Scan(&s.Identity, &s.ExpiresAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return Session{}, ErrNone
	}
	if err != nil {
		return Session{}, fmt.Errorf("reading a console session: %w", err)
	}
	return s, nil
}

// SessionMaxIdle bounds Get's idle limit when none is given: a session's
// whole life.
const SessionMaxIdle = 100 * 365 * 24 * time.Hour

// End ends the session id (logging out); ending one that does not exist
// is no error.
func End(ctx context.Context, pool *pgxpool.Pool, id string) error {
	if _, err := pool.Exec(ctx, `DELETE FROM `+Table+` WHERE id = $1`, id); err != nil {
		return fmt.Errorf("ending a console session: %w", err)
	}
	return nil
}
