// Package pgtoolcalls owns the agent tools' call records (ferry_tool_calls,
// migration 00011): one row per (tool, idempotency key) with the digest of
// the arguments, the stored result and the intents the call wrote. A host
// that retries a call gets the stored result instead of a second run.
package pgtoolcalls

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Table is the call record table.
const Table = "ferry_tool_calls"

// Querier is a transaction (or a pool).
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Claim records a call of tool with key and the arguments' digest. It
// reports false when the key is already recorded; a concurrent call with
// the same key waits here until the first commits or rolls back.
func Claim(ctx context.Context, q Querier, tool, key string, digest []byte) (bool, error) {
	tag, err := q.Exec(ctx, `INSERT INTO `+Table+` (tool, idempotency_key, args_sha256) VALUES ($1, $2, $3)
		ON CONFLICT DO NOTHING`, tool, key, digest)
	if err != nil {
		return false, fmt.Errorf("recording the call: %w", err)
	}
	return tag.RowsAffected() == 1, nil
}

// Call is a recorded call.
type Call struct {
	Digest    []byte
	Result    []byte
	IntentIDs []string
}

// ErrNoCall is returned by Get for a key not recorded.
var ErrNoCall = errors.New("no call of this tool with this key is recorded")

// Get reads the recorded call of tool with key.
func Get(ctx context.Context, q Querier, tool, key string) (Call, error) {
	var c Call
	err := q.QueryRow(ctx, `SELECT args_sha256, result, intent_ids FROM `+Table+` WHERE tool = $1 AND idempotency_key = $2`, tool, key).
		Scan(&c.Digest, &c.Result, &c.IntentIDs)
	if errors.Is(err, pgx.ErrNoRows) {
		return c, ErrNoCall
	}
	if err != nil {
		return c, fmt.Errorf("reading the tool call: %w", err)
	}
	return c, nil
}

// Queuer takes a statement to run with the commit (pgoutbox.Pending).
type Queuer interface {
	Queue(sql string, args ...any)
}

// QueueResult stores the call's result and intents with the transaction's
// commit.
func QueueResult(p Queuer, tool, key string, result []byte, intentIDs []string) {
	p.Queue(`UPDATE `+Table+` SET result = $3, intent_ids = $4 WHERE tool = $1 AND idempotency_key = $2`, tool, key, string(result), intentIDs)
}

// CountBefore counts the records created before cutoff.
func CountBefore(ctx context.Context, pool *pgxpool.Pool, cutoff time.Time) (int64, error) {
	var n int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+Table+` WHERE created_at < $1`, cutoff).Scan(&n); err != nil {
		return 0, fmt.Errorf("counting prunable tool calls: %w", err)
	}
	return n, nil
}

// DeleteBefore deletes at most n records created before cutoff, skipping
// rows others hold, and says how many went.
func DeleteBefore(ctx context.Context, pool *pgxpool.Pool, cutoff time.Time, n int) (int64, error) {
	tag, err := pool.Exec(ctx, `WITH doomed AS (
		SELECT tool, idempotency_key FROM `+Table+` WHERE created_at < $1 LIMIT $2 FOR UPDATE SKIP LOCKED)
		DELETE FROM `+Table+` c USING doomed d WHERE c.tool = d.tool AND c.idempotency_key = d.idempotency_key`, cutoff, n)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}
