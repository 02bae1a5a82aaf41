package pgoutbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The operator views. A row sent at its first try keeps dispatched_at
// NULL (the relay's position passes it, see lanes.go), so the obvious
// query, WHERE dispatched_at IS NULL, counts every row ever relayed as
// pending. A view per row state says it in SQL, for psql and Grafana
// panels, with the rules the relay and `ferry status` use: they are built
// from the same statements (stmt_pending.go), and the planner inlines a
// view, so a count over one reads the same indexes.
//
// Migration 00027 creates the default table's views; EnsureViews creates
// (or replaces) those of any other table and runs at `migrate up`.

// RowState is a state an outbox row can be in, with a view of its own.
type RowState string

// The row states with a view.
const (
	// StatePending: not dispatched yet, whatever the reason (new, delayed,
	// failing, held behind its aggregate, a durable retry waiting).
	StatePending RowState = "pending"
	// StateFailing: pending, and the relay tried to publish it and could
	// not (attempts and last_error say why).
	StateFailing RowState = "failing"
	// StateRetrying: a handler's durable retry waiting for its time.
	StateRetrying RowState = "retrying"
	// StateDispatched: handed to the broker, which confirmed it (marked, or
	// passed by the relay's position).
	StateDispatched RowState = "dispatched"
)

// RowStates are the states with a view, in the order they are created.
var RowStates = []RowState{StatePending, StateFailing, StateRetrying, StateDispatched}

// viewPrefix starts every view's name: ferry_<table>_<state>.
const viewPrefix = "ferry_"

// longestState is the longest state's name, for ParseTable's bound.
const longestState = len(StateDispatched)

// viewName is the view of rows in state s, unquoted.
func (t Table) viewName(s RowState) string { return viewPrefix + t.BaseName() + "_" + string(s) }

// View is the quoted name of the view of t's rows in state s, beside the
// table: ferry_outbox_pending for the default table's pending rows.
func (t Table) View(s RowState) string { return t.beside(t.viewName(s)) }

// viewSQL is the query of the view of state s. The failing and retrying
// views read the pending one (RowStates creates it first): one statement
// of what pending means.
func (t Table) viewSQL(s RowState) string {
	switch s {
	case StatePending:
		return `SELECT * FROM ` + t.pendingRows("o.*") + ` p`
	case StateFailing:
		return `SELECT * FROM ` + t.View(StatePending) + ` p WHERE ` + failingRule
	case StateRetrying:
		return `SELECT * FROM ` + t.View(StatePending) + ` p WHERE ` + retryRule
	case StateDispatched:
		return `SELECT o.* FROM ` + t.Quoted() + ` o WHERE ` + t.dispatchedCond("o")
	}
	panic(fmt.Sprintf("pgoutbox: no view for row state %q", s)) // RowStates lists every state
}

// ViewsDDL is the statements that create (or replace) t's views, one per
// RowStates entry; migration 00027 holds the default table's, and a test
// keeps the two the same.
func (t Table) ViewsDDL() []string {
	out := make([]string, 0, len(RowStates))
	for _, s := range RowStates {
		out = append(out, `CREATE OR REPLACE VIEW `+t.View(s)+` AS `+t.viewSQL(s))
	}
	return out
}

// Execer runs a statement: a pool, a connection or a transaction.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// EnsureViews creates or replaces t's views. The default table's come
// with migration 00027; a table of another name gets them here (`migrate
// up` calls it for FERRY_OUTBOX_TABLE).
func (t Table) EnsureViews(ctx context.Context, q Execer) error {
	for _, stmt := range t.ViewsDDL() {
		if _, err := q.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("creating the operator views of %s: %w", t.Quoted(), err)
		}
	}
	return nil
}

var _ Execer = (pgx.Tx)(nil)
