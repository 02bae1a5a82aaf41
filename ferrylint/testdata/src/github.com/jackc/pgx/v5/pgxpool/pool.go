// Package pgxpool is a stub for the analyzer's tests.
package pgxpool

import "context"

type Pool struct{}

func (p *Pool) Exec(ctx context.Context, sql string, args ...any) (int64, error) { return 0, nil }
