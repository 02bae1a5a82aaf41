// Package pgaudit is the audit log of operators' actions (ferry_audit_log,
// migration 00013): who requeued or discarded what, when, and how many,
// from the console or the command line.
package pgaudit

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/user"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Entry is one action.
type Entry struct {
	ID    int64     `json:"id"`
	At    time.Time `json:"at"`
	Actor string    `json:"actor"`
	// Address is where the action came from (the console's client
	// address, behind trusted proxies the forwarded one; "" from the
	// command line): a field of its own, never part of Actor, so that an
	// identity header cannot write one.
	Address string         `json:"address,omitempty"`
	Action  string         `json:"action"`
	Scope   string         `json:"scope"`
	Count   int            `json:"count"`
	Detail  map[string]any `json:"detail"`
}

type addressKey struct{}

// WithAddress returns ctx carrying the client address of the request an
// action serves: Record writes it into the entry when the entry names
// none. The console sets it once per request, so that every owner's
// action (poison, outbox, pauses, held heads) records it without passing
// it down.
func WithAddress(ctx context.Context, address string) context.Context {
	return context.WithValue(ctx, addressKey{}, address)
}

// AddressFrom returns the address WithAddress put in ctx, or "".
func AddressFrom(ctx context.Context) string {
	a, _ := ctx.Value(addressKey{}).(string)
	return a
}

// ErrConfirmationUsed is returned by Record for an entry whose
// Detail["confirmation"] an earlier entry recorded already (migration
// 00020's unique index): a confirmation is single-use, and the action
// recorded in the same transaction is rolled back with the entry.
var ErrConfirmationUsed = errors.New("this confirmation was used already: nothing was done a second time")

// Execer is a pool, a connection or a transaction. An action records its
// entry in the action's own transaction: an audit that cannot be written
// undoes the action, and an action that fails leaves no entry.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Record writes e (At and ID are set by the database) on q: the
// transaction of the action it records.
func Record(ctx context.Context, q Execer, e Entry) error {
	if e.Actor == "" || e.Action == "" {
		return errors.New("pgaudit: an entry needs an actor and an action")
	}
	if e.Detail == nil {
		e.Detail = map[string]any{}
	}
	if e.Address == "" {
		e.Address = AddressFrom(ctx)
	}
	if _, err := q.Exec(ctx, `INSERT INTO ferry_audit_log (actor, address, action, scope, count, detail) VALUES ($1, $2, $3, $4, $5, $6)`,
		e.Actor, e.Address, e.Action, e.Scope, e.Count, e.Detail); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.ConstraintName == "ferry_audit_log_confirmation" {
			return ErrConfirmationUsed
		}
		return fmt.Errorf("recording the audit entry: %w", err)
	}
	return nil
}

// selectEntries reads entries in Entry's field order (RowToStructByPos).
const selectEntries = `SELECT id, at, actor, address, action, scope, count, detail FROM ferry_audit_log`

// Latest returns the newest entry of action, or nil when there is none.
func Latest(ctx context.Context, pool *pgxpool.Pool, action string) (*Entry, error) {
	rows, err := pool.Query(ctx, selectEntries+` WHERE action = $1 ORDER BY id DESC LIMIT 1`, action)
	if err != nil {
		return nil, fmt.Errorf("reading the audit log: %w", err)
	}
	e, err := pgx.CollectOneRow(rows, pgx.RowToStructByPos[Entry])
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return &e, nil
}

// List returns the newest limit entries, newest first.
func List(ctx context.Context, pool *pgxpool.Pool, limit int) ([]Entry, error) {
	rows, err := pool.Query(ctx, selectEntries+` ORDER BY id DESC LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("reading the audit log: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Entry])
}

// CLIActor names the operator at a terminal: user@host.
func CLIActor() string {
	name := "unknown"
	if u, err := user.Current(); err == nil {
		name = u.Username
	}
	host, _ := os.Hostname()
	return "cli " + name + "@" + host
}
