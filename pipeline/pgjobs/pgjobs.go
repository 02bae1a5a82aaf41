// Package pgjobs keeps the console's background actions (ferry_jobs,
// migration 00023): an action too large for one request runs on in the
// process that took it, and records its progress and result here, so that
// its page can show them from any console process, after a reload or a
// lost reply, and a confirmation posted twice starts one job.
package pgjobs

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
)

// Table is the jobs table.
const Table = "ferry_jobs"

// States of a job.
const (
	Running = "running"
	Done    = "done"
	Failed  = "failed"
	// Interrupted is a running job whose process stopped reporting
	// (StaleAfter): what its committed pages did stays done, the rest was
	// not done.
	Interrupted = "interrupted"
)

// StaleAfter is how long a running job may go without reporting progress
// before it is shown as interrupted. A job reports after every page.
const StaleAfter = time.Minute

// Job is one background action.
type Job struct {
	ID         int64      `json:"id"`
	Action     string     `json:"action"`
	Scope      string     `json:"scope"`
	Actor      string     `json:"actor"`
	Total      int        `json:"total"`
	Done       int        `json:"done"`
	Skipped    int        `json:"skipped"`
	State      string     `json:"state"`
	Result     string     `json:"result"`
	Run        string     `json:"run"`
	StartedAt  time.Time  `json:"started_at"`
	UpdatedAt  time.Time  `json:"updated_at"`
	FinishedAt *time.Time `json:"finished_at"`
}

// ErrConfirmationUsed is returned by Start for a confirmation that started
// a job already.
var ErrConfirmationUsed = errors.New("this confirmation started a job already: nothing was started a second time")

// ErrNotFound is returned by Get for an unknown job.
var ErrNotFound = errors.New("no such job")

// Start records a running job of total messages, started by confirmation
// (its single-use nonce; "" for none).
func Start(ctx context.Context, pool *pgxpool.Pool, action, scope, actor, run, confirmation string, total int) (int64, error) {
	var conf *string
	if confirmation != "" {
		conf = &confirmation
	}
	var id int64
	err := pool.QueryRow(ctx, `INSERT INTO `+Table+` (action, scope, actor, run, confirmation, total) VALUES ($1, $2, $3, $4, $5, $6) RETURNING id`,
		action, pipeline.CleanText(scope, 1000), pipeline.CleanText(actor, 300), run, conf, total).Scan(&id)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23505" {
		return 0, ErrConfirmationUsed
	}
	if err != nil {
		return 0, fmt.Errorf("recording a background job: %w", err)
	}
	return id, nil
}

// Progress records how far job id got.
func Progress(ctx context.Context, pool *pgxpool.Pool, id int64, done, skipped int) error {
	if _, err := pool.Exec(ctx, `UPDATE `+Table+` SET done = $2, skipped = $3, updated_at = now() WHERE id = $1`, id, done, skipped); err != nil {
		return fmt.Errorf("recording a job's progress: %w", err)
	}
	return nil
}

// Finish records job id's end: Done or Failed, with what it did in words.
func Finish(ctx context.Context, pool *pgxpool.Pool, id int64, state string, done, skipped int, result string) error {
	if state != Done && state != Failed {
		return fmt.Errorf("pgjobs: a job finishes done or failed, not %q", state)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+Table+` SET state = $2, done = $3, skipped = $4, result = $5, updated_at = now(), finished_at = now() WHERE id = $1`,
		id, state, done, skipped, pipeline.CleanText(result, 4000)); err != nil {
		return fmt.Errorf("recording a job's end: %w", err)
	}
	return nil
}

const columns = `id, action, scope, actor, total, done, skipped,
	CASE WHEN state = 'running' AND updated_at < now() - $1 * interval '1 microsecond' THEN 'interrupted' ELSE state END,
	result, run, started_at, updated_at, finished_at`

// Get returns job id, a running one that stopped reporting as Interrupted.
func Get(ctx context.Context, pool *pgxpool.Pool, id int64) (Job, error) {
	rows, err := pool.Query(ctx, `SELECT `+columns+` FROM `+Table+` WHERE id = $2`, StaleAfter.Microseconds(), id)
	if err != nil {
		return Job{}, fmt.Errorf("reading a job: %w", err)
	}
	j, err := pgx.CollectOneRow(rows, pgx.RowToStructByPos[Job])
	if errors.Is(err, pgx.ErrNoRows) {
		return Job{}, ErrNotFound
	}
	return j, err
}

// List returns the newest limit jobs, newest first.
func List(ctx context.Context, pool *pgxpool.Pool, limit int) ([]Job, error) {
	rows, err := pool.Query(ctx, `SELECT `+columns+` FROM `+Table+` ORDER BY id DESC LIMIT $2`, StaleAfter.Microseconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("reading jobs: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Job])
}
