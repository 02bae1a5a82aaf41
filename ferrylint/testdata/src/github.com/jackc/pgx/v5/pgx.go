// Package pgx is a stub for the analyzer's tests.
package pgx

import "context"

type Tx interface {
	Exec(ctx context.Context, sql string, args ...any) (int64, error)
}
