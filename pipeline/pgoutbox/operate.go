package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgaudit"
	"github.com/ferry-dev/ferry/pipeline/pgfilter"
	"github.com/ferry-dev/ferry/pipeline/pgweeks"
)

// The two kinds of pending rows an operator acts on, each defined once:
// the console's pages, its actions, `ferry status` and the metrics all
// read these conditions, never a copy of them.
const (
	// failingRule: a row the relay tried to publish and could not (it
	// keeps the row, with its last error, until the broker takes it).
	// Both are conditions on the pending rows (PendingRows).
	failingRule = `attempts > 0 AND last_error IS NOT NULL`
	// retryRule: a handler's durable retry waiting in the outbox for its
	// time (middleware.DurableRetry writes it on pipeline.RetryTopic).
	retryRule = `topic = '` + pipeline.RetryTopic + `'`
)

// failingColumns are the outbox's columns for a pgfilter.Filter over the
// failing rows.
var failingColumns = pgfilter.Columns{Topic: "topic", AggregateID: "aggregate_id", Text: "last_error",
	Fingerprint: "ferry_fingerprint(last_error)", Time: "created_at", CorrelationID: "headers->>'" + pipeline.MetaCorrelationID + "'", MessageID: "message_uuid",
	Tenant: "headers->>'" + pipeline.MetaTenantID + "'"}

// Operator reads the outbox as an operator sees it and runs an operator's
// actions on it (retry now, discard), each with its audit entry in the
// action's own transaction. The console, the command line and agent tools
// share it, so they cannot disagree about what a failing row is.
type Operator struct {
	pool    *pgxpool.Pool
	t       Table
	table   string // t, quoted
	pending string // pendingRows, every column
}

// NewOperator returns the operator over the outbox table t.
func NewOperator(pool *pgxpool.Pool, t Table) (*Operator, error) {
	if pool == nil {
		return nil, errors.New("pgoutbox: NewOperator needs a pool")
	}
	return &Operator{pool: pool, t: t, table: t.Quoted(), pending: t.pendingRows("o.*")}, nil
}

// FailingCount counts the rows the relay keeps failing to publish.
func (o *Operator) FailingCount(ctx context.Context) (int, error) {
	return o.t.CountFailing(ctx, o.pool)
}

// FailingGroup is the failing rows of one error fingerprint.
type FailingGroup struct {
	Fingerprint string
	Count       int
	Topics      string
	Example     string
	MaxAttempts int
	FirstSeen   time.Time
	LastSeen    time.Time
	NextTry     time.Time
}

// FailingRow is one row the relay keeps failing to publish.
type FailingRow struct {
	ID          int64
	Topic       string
	AggregateID string
	Attempts    int
	LastError   string
	CreatedAt   time.Time
	NextTry     time.Time
}

func failingWhere(f pgfilter.Filter, first int) (string, []any) {
	cond, args := f.SQL(first, failingColumns)
	return failingRule + " AND " + cond, args
}

// FailingGroups groups the failing rows f chooses by fingerprint, largest
// first, at most limit groups.
func (o *Operator) FailingGroups(ctx context.Context, f pgfilter.Filter, limit int) ([]FailingGroup, error) {
	where, args := failingWhere(f, 2)
	rows, err := o.pool.Query(ctx, `SELECT ferry_fingerprint(last_error), count(*), string_agg(DISTINCT topic, ', '),
		(array_agg(last_error ORDER BY id DESC))[1], max(attempts), min(created_at), max(created_at), min(available_at)
		FROM `+o.pending+` o WHERE `+where+` GROUP BY 1 ORDER BY 2 DESC LIMIT $1`, append([]any{limit}, args...)...)
	if err != nil {
		return nil, fmt.Errorf("grouping failing outbox rows: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[FailingGroup])
}

// FailingRows lists the failing rows f chooses after f.AfterID, by id, at
// most limit.
func (o *Operator) FailingRows(ctx context.Context, f pgfilter.Filter, limit int) ([]FailingRow, error) {
	where, args := failingWhere(f, 3)
	rows, err := o.pool.Query(ctx, `SELECT id, topic, aggregate_id, attempts, last_error, created_at, available_at
		FROM `+o.pending+` o WHERE id > $1 AND `+where+` ORDER BY id LIMIT $2`, append([]any{f.AfterID, limit}, args...)...)
	if err != nil {
		return nil, fmt.Errorf("listing failing outbox rows: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[FailingRow])
}

// ErrNoRow is returned by Operator.Row for an id the outbox does not hold.
var ErrNoRow = errors.New("no such outbox row")

// Row reads one row whole, its payload too.
func (o *Operator) Row(ctx context.Context, id int64) (Row, error) {
	rows, err := o.pool.Query(ctx, `SELECT `+rowColumns(o.t.dispatchedCond("o"), true)+` FROM `+o.table+` o WHERE o.id = $1`, id)
	if err != nil {
		return Row{}, fmt.Errorf("reading outbox row %d: %w", id, err)
	}
	row, err := pgx.CollectExactlyOneRow(rows, scanRowPayload)
	if errors.Is(err, pgx.ErrNoRows) {
		return row, ErrNoRow
	}
	if err != nil {
		return row, fmt.Errorf("reading outbox row %d: %w", id, err)
	}
	return row, nil
}

// PendingKind is which pending rows an action chooses from.
type PendingKind string

const (
	// Failing rows: the relay cannot publish them.
	Failing PendingKind = "failing"
	// Retrying rows: handlers' durable retries waiting for their time.
	Retrying PendingKind = "retrying"
)

// Stuck chooses pending rows of one kind: a group (Fingerprint, and for
// Retrying the Handler) or rows by id (IDs, still of that kind).
type Stuck struct {
	Kind        PendingKind
	Fingerprint string
	Handler     string
	IDs         []int64
	// Limit, if set, takes at most that many (oldest first).
	Limit int
}

// Validate refuses a selection that names no kind or no rows.
func (p Stuck) Validate() error {
	if p.Kind != Failing && p.Kind != Retrying {
		return fmt.Errorf("pgoutbox: the kind must be %q or %q, got %q", Failing, Retrying, p.Kind)
	}
	if len(p.IDs) == 0 && p.Fingerprint == "" {
		return errors.New("pgoutbox: choose rows by id or a group by its fingerprint")
	}
	for _, id := range p.IDs {
		if id <= 0 {
			return fmt.Errorf("pgoutbox: %d is not an outbox row id", id)
		}
	}
	if p.Limit < 0 {
		return errors.New("pgoutbox: Limit must not be negative")
	}
	return nil
}

// String is the selection in words, for the audit log.
func (p Stuck) String() string {
	if len(p.IDs) > 0 {
		ids := make([]string, len(p.IDs))
		for i, id := range p.IDs {
			ids[i] = strconv.FormatInt(id, 10)
		}
		return string(p.Kind) + " rows " + strings.Join(ids, ",")
	}
	if p.Kind == Retrying {
		return "retries of " + p.Handler + " with fingerprint " + p.Fingerprint
	}
	return "failing rows with fingerprint " + p.Fingerprint
}

func (p Stuck) where() (string, []any) {
	rule := failingRule
	if p.Kind == Retrying {
		rule = retryRule
	}
	var cond string
	var args []any
	switch {
	case len(p.IDs) > 0:
		cond, args = rule+` AND id = ANY($1)`, []any{p.IDs}
	case p.Kind == Retrying:
		cond, args = rule+` AND ferry_fingerprint(headers->>'`+pipeline.MetaLastError+`') = $1 AND coalesce(headers->>'`+pipeline.MetaRetryQueue+`', '') = $2`,
			[]any{p.Fingerprint, p.Handler}
	default:
		cond, args = rule+` AND ferry_fingerprint(last_error) = $1`, []any{p.Fingerprint}
	}
	return cond, args
}

// chosen is p as the ids it takes: its condition on the pending rows,
// oldest first, at most Limit, locked for the action.
func (p Stuck) chosen(table, pending string) (string, []any) {
	where, args := p.where()
	limit := ""
	if p.Limit > 0 {
		args = append(args, p.Limit)
		limit = ` LIMIT $` + strconv.Itoa(len(args))
	}
	return `SELECT id FROM ` + table + ` WHERE id IN (SELECT o.id FROM ` + pending + ` o WHERE ` + where + `) ORDER BY id` + limit + ` FOR UPDATE`, args
}

// Count counts the rows p chooses now (all of them: Limit does not cap
// the count, so a caller sees how many it leaves).
func (o *Operator) Count(ctx context.Context, p Stuck) (int, error) {
	if err := p.Validate(); err != nil {
		return 0, err
	}
	where, args := p.where()
	var n int
	if err := o.pool.QueryRow(ctx, `SELECT count(*) FROM `+o.pending+` o WHERE `+where, args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("counting %s: %w", p, err)
	}
	return n, nil
}

// SelectIDs returns the ids of the rows p chooses now, oldest first, at
// most limit (0: all), and how many it chooses in all: what a preview
// shows and a confirmation then binds the action to (pgconfirm: the action
// takes these ids, still of p's kind, and nothing else).
func (o *Operator) SelectIDs(ctx context.Context, p Stuck, limit int) (ids []int64, total int, err error) {
	if err := p.Validate(); err != nil {
		return nil, 0, err
	}
	p.Limit = limit
	q, args := p.chosen(o.table, o.pending)
	where, countArgs := p.where()
	err = pgx.BeginFunc(ctx, o.pool, func(tx pgx.Tx) error {
		// One snapshot for the count and the ids.
		if _, err := tx.Exec(ctx, `SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY`); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM `+o.pending+` o WHERE `+where, countArgs...).Scan(&total); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, strings.TrimSuffix(q, ` FOR UPDATE`), args...)
		if err != nil {
			return err
		}
		ids, err = pgx.CollectRows(rows, pgx.RowTo[int64])
		return err
	})
	if err != nil {
		return nil, 0, fmt.Errorf("selecting %s: %w", p, err)
	}
	return ids, total, nil
}

// By says who acts and, for a console action, the single-use nonce of the
// confirmation acted on (recorded with the audit entry: a second use fails
// with pgaudit.ErrConfirmationUsed and changes nothing).
type By struct {
	Actor        string
	Confirmation string
}

// Acted says what RetryNow or Discard did.
type Acted struct {
	// IDs are the rows acted on.
	IDs []int64 `json:"ids"`
}

// RetryNow makes the rows p chooses due at once and records the audit
// entry (actor, the ids) in the same transaction.
func (o *Operator) RetryNow(ctx context.Context, p Stuck, by By) (Acted, error) {
	return o.act(ctx, p, by, "retry-now", `UPDATE `+o.table+` o SET available_at = now() FROM chosen WHERE o.id = chosen.id`)
}

// Discard deletes the rows p chooses and records the audit entry (actor,
// the ids, their message ids) in the same transaction.
func (o *Operator) Discard(ctx context.Context, p Stuck, by By) (Acted, error) {
	return o.act(ctx, p, by, "discard", `DELETE FROM `+o.table+` o USING chosen WHERE o.id = chosen.id`)
}

func (o *Operator) act(ctx context.Context, p Stuck, by By, action, stmt string) (Acted, error) {
	var res Acted
	if err := p.Validate(); err != nil {
		return res, err
	}
	if by.Actor == "" {
		return res, errors.New("pgoutbox: an operator's action needs an actor for the audit log")
	}
	chosen, args := p.chosen(o.table, o.pending)
	// A retry made due wakes the relays once it commits.
	actx, committed := pipeline.WithAfterCommit(ctx)
	err := pgx.BeginFunc(actx, o.pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(actx, `WITH chosen AS (`+chosen+`) `+stmt+` RETURNING o.id, coalesce(o.message_uuid, '')`, args...)
		if err != nil {
			return fmt.Errorf("%s %s: %w", action, p, err)
		}
		var messages []string
		res.IDs, messages = nil, nil
		for rows.Next() {
			var id int64
			var msg string
			if err := rows.Scan(&id, &msg); err != nil {
				rows.Close()
				return err
			}
			res.IDs, messages = append(res.IDs, id), append(messages, msg)
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("%s %s: %w", action, p, err)
		}
		if len(res.IDs) == 0 && by.Confirmation == "" {
			return nil
		}
		detail := map[string]any{"ids": res.IDs, "message_ids": messages}
		if by.Confirmation != "" {
			detail["confirmation"] = by.Confirmation
		}
		return pgaudit.Record(actx, tx, pgaudit.Entry{Actor: by.Actor, Action: "outbox." + string(p.Kind) + "." + action, Scope: p.String(),
			Count: len(res.IDs), Detail: detail})
	})
	if err != nil {
		return Acted{}, err
	}
	committed()
	return res, nil
}

// PendingCount counts the rows of the outbox table t not dispatched yet.
func (t Table) PendingCount(ctx context.Context, q Reader) (int64, error) {
	return t.CountPending(ctx, q, PendingFilter{})
}

// dispatchedBefore is true of row o when it was dispatched before $1:
// marked so, or passed by the relay and written before $1 (the relay
// passes a row moments after its commit and records no time per row).
func (t Table) dispatchedBefore() string {
	return `(o.dispatched_at < $1 OR ` + t.passedUnmarked("o", "o.created_at < $1") + `)`
}

// CountDispatchedBefore counts the rows of the outbox table t dispatched
// before cutoff that retention removes row by row: those of its legacy
// partition when it is partitioned (ClearPartitions empties the others
// whole).
func (t Table) CountDispatchedBefore(ctx context.Context, pool *pgxpool.Pool, cutoff time.Time) (int64, error) {
	rel, err := pgweeks.LegacyRelation(ctx, pool, t.Quoted())
	if err != nil || rel == "" {
		return 0, err
	}
	var n int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+rel+` o WHERE `+t.dispatchedBefore(), cutoff).Scan(&n); err != nil {
		return 0, fmt.Errorf("counting prunable outbox rows: %w", err)
	}
	return n, nil
}

// DeleteDispatchedBefore removes at most n rows dispatched before cutoff
// (of the legacy partition only, when the table is partitioned),
// oldest first, skipping rows others hold; with archive it moves them into
// the archive table (the outbox's name with "_archive") in the same
// statement. It says how many went.
func (t Table) DeleteDispatchedBefore(ctx context.Context, pool *pgxpool.Pool, cutoff time.Time, n int, archive bool) (int64, error) {
	rel, err := pgweeks.LegacyRelation(ctx, pool, t.Quoted())
	if err != nil || rel == "" {
		return 0, err
	}
	stmt := `WITH doomed AS (
		SELECT id FROM ` + rel + ` o WHERE ` + t.dispatchedBefore() + ` ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)
		DELETE FROM ` + rel + ` o USING doomed d WHERE o.id = d.id`
	if archive {
		stmt = `WITH doomed AS (
			SELECT id FROM ` + rel + ` o WHERE ` + t.dispatchedBefore() + ` ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED),
			moved AS (DELETE FROM ` + rel + ` o USING doomed d WHERE o.id = d.id RETURNING o.*)
			INSERT INTO ` + t.Archive() + ` SELECT * FROM moved ON CONFLICT (id) DO NOTHING`
	}
	tag, err := pool.Exec(ctx, stmt, cutoff, n)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}
