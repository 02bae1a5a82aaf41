// Package pgpause keeps the handlers an operator paused
// (ferry_handler_pauses, migration 00023): River and Temporal let an
// operator stop one queue's work during an incident without stopping the
// process; so does Ferry. A paused handler's consumers wait before
// handling (their deliveries stay unacked, in order, and the broker holds
// the rest) until it is resumed; every process sees the same state within
// middleware.PauseConfig.Poll. Pausing and resuming are audited.
package pgpause

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
)

// Table is the pauses table.
const Table = "ferry_handler_pauses"

// Audit log actions.
const (
	PauseAction  = "handler.pause"
	ResumeAction = "handler.resume"
)

// Pause is one paused handler.
type Pause struct {
	Handler string    `json:"handler"`
	At      time.Time `json:"paused_at"`
	By      string    `json:"paused_by"`
	Reason  string    `json:"reason"`
}

var (
	// ErrPaused is returned by Set for a handler paused already.
	ErrPaused = errors.New("this handler is paused already")
	// ErrNotPaused is returned by Clear for a handler that is not paused.
	ErrNotPaused = errors.New("this handler is not paused")
)

func check(handler string) error {
	if handler == "" || strings.Contains(handler, pipeline.PartitionSeparator) || len(handler) > 200 {
		return fmt.Errorf("pause: %q is not a route's name (a route, not one of its partitions: no %q)", handler, pipeline.PartitionSeparator)
	}
	return nil
}

// Set pauses handler (a route's name: all its partitions or workers) on
// behalf of actor, with why.
func Set(ctx context.Context, pool *pgxpool.Pool, handler, actor, reason string) error {
	if err := check(handler); err != nil {
		return err
	}
	if actor == "" {
		return errors.New("pgpause: a pause needs an actor for the audit log")
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `INSERT INTO `+Table+` (handler, paused_by, reason) VALUES ($1, $2, $3) ON CONFLICT (handler) DO NOTHING`,
			handler, actor, pipeline.CleanText(reason, 500))
		if err != nil {
			return fmt.Errorf("pausing %s: %w", handler, err)
		}
		if tag.RowsAffected() == 0 {
			return ErrPaused
		}
		return pgaudit.Record(ctx, tx, pgaudit.Entry{Actor: actor, Action: PauseAction, Scope: "handler " + handler, Count: 1,
			Detail: map[string]any{"reason": pipeline.CleanText(reason, 500)}})
	})
}

// Clear resumes handler on behalf of actor.
func Clear(ctx context.Context, pool *pgxpool.Pool, handler, actor string) error {
	if err := check(handler); err != nil {
		return err
	}
	if actor == "" {
		return errors.New("pgpause: a resume needs an actor for the audit log")
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var since time.Time
		err := tx.QueryRow(ctx, `DELETE FROM `+Table+` WHERE handler = $1 RETURNING paused_at`, handler).Scan(&since)
		if errors.Is(err, pgx.ErrNoRows) {
			return ErrNotPaused
		}
		if err != nil {
			return fmt.Errorf("resuming %s: %w", handler, err)
		}
		return pgaudit.Record(ctx, tx, pgaudit.Entry{Actor: actor, Action: ResumeAction, Scope: "handler " + handler, Count: 1,
			Detail: map[string]any{"paused_at": since}})
	})
}

// Reader is a pool, a connection or a transaction.
type Reader interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// List returns the paused handlers, the longest paused first.
func List(ctx context.Context, q Reader) ([]Pause, error) {
	rows, err := q.Query(ctx, `SELECT handler, paused_at, paused_by, reason FROM `+Table+` ORDER BY paused_at, handler`)
	if err != nil {
		return nil, fmt.Errorf("reading paused handlers: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Pause])
}

// Source is the paused handlers for middleware.PauseConfig.
type Source struct{ Pool *pgxpool.Pool }

// Paused returns the names of the paused handlers.
func (s Source) Paused(ctx context.Context) (map[string]bool, error) {
	rows, err := s.Pool.Query(ctx, `SELECT handler FROM `+Table)
	if err != nil {
		return nil, fmt.Errorf("reading paused handlers: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("reading paused handlers: %w", err)
	}
	out := make(map[string]bool, len(names))
	for _, n := range names {
		out[n] = true
	}
	return out, nil
}
