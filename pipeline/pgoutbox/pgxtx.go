package pgoutbox

import (
	"context"
	"database/sql"
	"errors"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// PgxTx lets a pgx transaction stand where watermill-sql expects a
// database/sql one, so that PublishTx writes into it: a handler's ledger
// transaction (pgledger.TxFromContext) or any pgx.BeginFunc of the caller.
//
// Written by hand because watermill-sql/v3 knows only database/sql (its v4
// has TxFromPgx, but Ferry stays on v3). Watermill's SQL publisher only
// executes the INSERT its schema adapter builds (ExecContext); the query
// methods, which must return database/sql's concrete row types, cannot be
// served by pgx and report errors instead. Do not hand the result to a
// watermill-sql Subscriber.
//
// A *pgxpool.Pool or *pgx.Conn is accepted too: each publish is then its
// own transaction.
func PgxTx(tx PgxExecer) wsql.ContextExecutor { return pgxExecutor{tx} }

// PgxExecer is what PgxTx needs: pgx.Tx, *pgx.Conn and *pgxpool.Pool have it.
type PgxExecer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

var _ PgxExecer = pgx.Tx(nil)

type pgxExecutor struct{ tx PgxExecer }

var errPgxQuery = errors.New("pgoutbox.PgxTx: only Exec is supported (it adapts a pgx.Tx for Watermill's SQL publisher)")

func (e pgxExecutor) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	tag, err := e.tx.Exec(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return pgxResult(tag.RowsAffected()), nil
}

func (e pgxExecutor) Exec(query string, args ...any) (sql.Result, error) {
	return e.ExecContext(context.Background(), query, args...)
}

func (e pgxExecutor) QueryContext(context.Context, string, ...any) (*sql.Rows, error) {
	return nil, errPgxQuery
}

func (e pgxExecutor) Query(string, ...any) (*sql.Rows, error) { return nil, errPgxQuery }

// QueryRowContext cannot carry an error in a *sql.Row built outside
// database/sql; the publisher never calls it.
func (e pgxExecutor) QueryRowContext(context.Context, string, ...any) *sql.Row { return nil }

func (e pgxExecutor) QueryRow(string, ...any) *sql.Row { return nil }

type pgxResult int64

func (pgxResult) LastInsertId() (int64, error) {
	return 0, errors.New("LastInsertId is not supported by PostgreSQL")
}
func (r pgxResult) RowsAffected() (int64, error) { return int64(r), nil }
