package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The write_overhead and claim_cost scenarios.

func benchWriteOverhead(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	sch, err := newBenchSchema(ctx, cfg, 4)
	if err != nil {
		return benchReport{}, err
	}
	defer sch.drop()
	ob, err := pgoutbox.New(pgoutbox.Config{}, logger)
	if err != nil {
		return benchReport{}, err
	}
	svc, err := orders.NewService(sch.db, ob, logger)
	if err != nil {
		return benchReport{}, err
	}
	// create_order's own statement, without its events: the same text on
	// every bare path.
	const bareOrderSQL = `INSERT INTO orders (user_id, amount, currency, idempotency_key)
		VALUES ($1, $2, $3, $4) ON CONFLICT (idempotency_key) DO NOTHING RETURNING id`
	without := func(i int) error {
		tx, err := sch.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		var id int64
		if err := tx.QueryRowContext(ctx, bareOrderSQL,
			"user-1", 1200, "JPY", fmt.Sprintf("plain-%d", i)).Scan(&id); err != nil {
			return err
		}
		return tx.Commit()
	}
	with := func(i int) error {
		_, err := svc.CreateOrder(ctx, orders.Input{UserID: "user-1", Amount: 1200, Currency: "JPY", IdempotencyKey: fmt.Sprintf("outbox-%d", i)})
		return err
	}
	// The pgx pair: the bare transaction, and the events written with the
	// COMMIT in one round trip (pgoutbox.Outbox.InTx).
	withoutPgx := func(i int) error {
		return pgx.BeginFunc(ctx, sch.pool, func(tx pgx.Tx) error {
			var id int64
			return tx.QueryRow(ctx, bareOrderSQL,
				"user-1", 1200, "JPY", fmt.Sprintf("plain-pgx-%d", i)).Scan(&id)
		})
	}
	withInTx := func(i int) error {
		_, err := orders.CreateOrderInTx(ctx, ob, sch.pool, orders.Input{UserID: "user-1", Amount: 1200, Currency: "JPY", IdempotencyKey: fmt.Sprintf("intx-%d", i)})
		return err
	}
	// The same InTx transaction without its events: what the events
	// themselves cost at the same round-trip count (InTx sends BEGIN with
	// the first statement, which pgx.BeginFunc cannot).
	withoutInTx := func(i int) error {
		return ob.InTx(ctx, sch.pool, func(ctx context.Context, q pgoutbox.Querier, _ *pgoutbox.Pending) error {
			var id int64
			return q.QueryRow(ctx, bareOrderSQL,
				"user-1", 1200, "JPY", fmt.Sprintf("plain-intx-%d", i)).Scan(&id)
		})
	}
	// Warm up every path (connections, plans), then interleave so drift in
	// the machine's load hits all alike.
	for i := range 50 {
		if err := errors.Join(without(-1-i), with(-1-i), withoutPgx(-1-i), withInTx(-1-i), withoutInTx(-1-i)); err != nil {
			return benchReport{}, err
		}
	}
	var lw, lo, lp, li, ln latencies
	variants := [5]struct {
		run func(int) error
		lat *latencies
	}{{with, &lw}, {without, &lo}, {withInTx, &li}, {withoutPgx, &lp}, {withoutInTx, &ln}}
	for i := range bc.Orders {
		for j := range variants {
			v := variants[(i+j)%len(variants)]
			t0 := time.Now()
			if err := v.run(i); err != nil {
				return benchReport{}, err
			}
			*v.lat = append(*v.lat, time.Since(t0))
		}
	}
	sw, so, si, sp, sn := lw.summary(), lo.summary(), li.summary(), lp.summary(), ln.summary()
	ratioP50, ratioMean := sw["p50_ms"]/so["p50_ms"], sw["mean_ms"]/so["mean_ms"]
	inTxP50, inTxMean := si["p50_ms"]/sp["p50_ms"], si["mean_ms"]/sp["mean_ms"]
	eventsP50, eventsMean := si["p50_ms"]/sn["p50_ms"], si["mean_ms"]/sn["mean_ms"]
	var tb strings.Builder
	fmt.Fprintf(&tb, "%-44s %8s %8s %8s\n", "", "p50 ms", "p95 ms", "mean ms")
	for _, r := range []struct {
		name string
		s    map[string]float64
	}{{"create_order with 2 events (database/sql)", sw}, {"create_order without events (database/sql)", so},
		{"create_order with 2 events (InTx)", si}, {"create_order without events (pgx.BeginFunc)", sp},
		{"create_order without events (InTx)", sn}} {
		fmt.Fprintf(&tb, "%-44s %8.3f %8.3f %8.3f\n", r.name, r.s["p50_ms"], r.s["p95_ms"], r.s["mean_ms"])
	}
	fmt.Fprintf(&tb, "overhead, PublishTx on database/sql: %+.0f%% at p50, %+.0f%% on the mean\n", 100*(ratioP50-1), 100*(ratioMean-1))
	fmt.Fprintf(&tb, "overhead, InTx with events vs the bare pgx.BeginFunc transaction: %+.0f%% at p50, %+.0f%% on the mean\n", 100*(inTxP50-1), 100*(inTxMean-1))
	fmt.Fprintf(&tb, "the events alone, InTx with vs without them: %+.0f%% at p50, %+.0f%% on the mean\n", 100*(eventsP50-1), 100*(eventsMean-1))
	return benchReport{
		JSON: map[string]any{
			"params":                  map[string]any{"orders_per_variant": bc.Orders},
			"with_events":             sw,
			"without_events":          so,
			"ratio_p50":               ratioP50,
			"ratio_mean":              ratioMean,
			"in_tx_with_events":       si,
			"pgx_without_events":      sp,
			"in_tx_without_events":    sn,
			"in_tx_ratio_p50":         inTxP50,
			"in_tx_ratio_mean":        inTxMean,
			"in_tx_events_ratio_p50":  eventsP50,
			"in_tx_events_ratio_mean": eventsMean,
			"targets": map[string]any{"overhead_max": 0.25, "overhead_met": ratioP50 <= 1.25,
				"in_tx_overhead_met": inTxP50 <= 1.25, "in_tx_events_overhead_met": eventsP50 <= 1.25},
		},
		Table: tb.String(),
	}, nil
}

func benchClaimCost(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	type row struct {
		History int                `json:"dispatched_rows"`
		Claim   map[string]float64 `json:"claim"`
	}
	var rows []row
	for _, h := range bc.History {
		sch, err := newBenchSchema(ctx, cfg, 2)
		if err != nil {
			return benchReport{}, err
		}
		lat, err := claimRounds(ctx, sch.pool, h, bc)
		sch.drop()
		if err != nil {
			return benchReport{}, err
		}
		rows = append(rows, row{History: h, Claim: lat.summary()})
	}
	first, last := rows[0], rows[len(rows)-1]
	ratio := last.Claim["p50_ms"] / first.Claim["p50_ms"]
	var tb strings.Builder
	fmt.Fprintf(&tb, "%-16s %8s %8s %8s\n", "dispatched rows", "p50 ms", "p95 ms", "p99 ms")
	for _, r := range rows {
		fmt.Fprintf(&tb, "%-16d %8.3f %8.3f %8.3f\n", r.History, r.Claim["p50_ms"], r.Claim["p95_ms"], r.Claim["p99_ms"])
	}
	fmt.Fprintf(&tb, "claim p50 at %d / at %d: %.2fx\n", last.History, first.History, ratio)
	return benchReport{
		JSON: map[string]any{
			"params":                        map[string]any{"history": bc.History, "rounds": bc.ClaimRounds, "batch_size": bc.BatchSize},
			"runs":                          rows,
			"ratio_p50_largest_vs_smallest": ratio,
			"targets":                       map[string]any{"ratio_max": 1.5, "ratio_met": ratio <= 1.5},
		},
		Table: tb.String(),
	}, nil
}

// claimRounds fills the table with history dispatched rows (as a vacuumed
// production table holds them), then times the slow lane's claim query
// (failed and delayed rows: see pgoutbox's lanes) over a fresh batch of
// pending rows, round after round.
func claimRounds(ctx context.Context, pool *pgxpool.Pool, history int, bc BenchConfig) (latencies, error) {
	for done := 0; done < history; done += 1_000_000 {
		n := min(1_000_000, history-done)
		if _, err := pool.Exec(ctx, `INSERT INTO `+outboxSQL+` (aggregate_id, topic, payload, headers, created_at, available_at, dispatched_at, attempts)
			SELECT (g % 1000)::text, $1, jsonb_build_object('order_id', g), '{"schema_version":"1"}',
			       now() - interval '1 day', now() - interval '1 day', now() - interval '1 day', 1
			FROM generate_series(1, $2::int) g`, benchTopic, n); err != nil {
			return nil, fmt.Errorf("loading history: %w", err)
		}
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+outboxSQL); err != nil {
		return nil, err
	}
	claim := pgoutbox.Table{}.ClaimSQL(false)
	var lat latencies
	for range bc.ClaimRounds {
		if _, err := pool.Exec(ctx, `INSERT INTO `+outboxSQL+` (aggregate_id, topic, payload, slow) SELECT g::text, $1, '{}', true FROM generate_series(1, $2::int) g`, benchTopic, bc.BatchSize); err != nil {
			return nil, err
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			return nil, err
		}
		t0 := time.Now()
		rows, err := tx.Query(ctx, claim, pgx.NamedArgs{"limit": bc.BatchSize})
		if err != nil {
			_ = tx.Rollback(ctx)
			return nil, err
		}
		var ids []int64
		for rows.Next() {
			var (
				id         int64
				uuid       *string
				agg, topic string
				payload    []byte
				headers    map[string]any
				attempts   int
				created    time.Time
				due        time.Time
				shadow     bool
				prev       *int64
			)
			if err := rows.Scan(&id, &uuid, &agg, &topic, &payload, &headers, &attempts, &created, &due, &shadow, &prev); err != nil {
				rows.Close()
				_ = tx.Rollback(ctx)
				return nil, err
			}
			ids = append(ids, id)
		}
		rows.Close()
		lat = append(lat, time.Since(t0))
		if _, err := tx.Exec(ctx, `UPDATE `+outboxSQL+` SET dispatched_at = now() WHERE id = ANY($1)`, ids); err != nil {
			_ = tx.Rollback(ctx)
			return nil, err
		}
		if err := tx.Commit(ctx); err != nil {
			return nil, err
		}
	}
	return lat, nil
}
