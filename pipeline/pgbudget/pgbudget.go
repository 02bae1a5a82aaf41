// Package pgbudget keeps spend budgets in PostgreSQL (budget_usage,
// migration 00006) for the budget breaker middleware: one counter per
// budget and window, shared by every consumer process, incremented only
// while it stays within the limit, in one atomic statement.
package pgbudget

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Spender spends from budgets.
type Spender struct {
	pool *pgxpool.Pool
	now  func() time.Time
}

// New returns a Spender over pool.
func New(pool *pgxpool.Pool) (*Spender, error) {
	if pool == nil {
		return nil, errors.New("pgbudget: New needs a pool")
	}
	return &Spender{pool: pool, now: time.Now}, nil
}

// Spend takes cost from budget's current window (windows of length window,
// aligned to the Unix epoch, so a day is a UTC day) if that leaves it within
// limit. Otherwise nothing is taken and retryAfter is the time left until
// the next window opens.
func (s *Spender) Spend(ctx context.Context, budget string, cost, limit int64, window time.Duration) (ok bool, retryAfter time.Duration, err error) {
	if window <= 0 || limit <= 0 || cost < 0 {
		return false, 0, errors.New("pgbudget: window and limit must be positive and cost not negative")
	}
	now := s.now()
	start := time.Unix(0, 0).Add(now.Sub(time.Unix(0, 0)).Truncate(window))
	retryAfter = start.Add(window).Sub(now)
	if cost > limit {
		return false, retryAfter, fmt.Errorf("pgbudget: a cost of %d can never fit budget %q's limit of %d", cost, budget, limit)
	}
	var used int64
	err = s.pool.QueryRow(ctx, `INSERT INTO budget_usage (budget, window_start, used) VALUES ($1, $2, $3)
		ON CONFLICT (budget, window_start) DO UPDATE SET used = budget_usage.used + EXCLUDED.used
		WHERE budget_usage.used + EXCLUDED.used <= $4
		RETURNING used`, budget, start, cost, limit).Scan(&used)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, retryAfter, nil
	}
	if err != nil {
		return false, 0, fmt.Errorf("spending from budget %q: %w", budget, err)
	}
	return true, 0, nil
}

// Used returns what budget has spent in the window containing now.
func (s *Spender) Used(ctx context.Context, budget string, window time.Duration) (int64, error) {
	now := s.now()
	start := time.Unix(0, 0).Add(now.Sub(time.Unix(0, 0)).Truncate(window))
	var used int64
	err := s.pool.QueryRow(ctx, `SELECT coalesce(sum(used), 0) FROM budget_usage WHERE budget = $1 AND window_start = $2`, budget, start).Scan(&used)
	return used, err
}
