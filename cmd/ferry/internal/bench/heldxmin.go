package bench

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// ScenarioHeldXmin measures what one long transaction elsewhere (a report,
// pg_dump, a standby's hot_standby_feedback) costs the relay: rounds of
// events inserted and drained, first with nothing holding the horizon,
// then with one REPEATABLE READ transaction open the whole time, in the
// same run. It runs on a PostgreSQL server of its own with autovacuum on
// (production's default; the shared test server has it off), so that
// what vacuum can and cannot clean shows.
const ScenarioHeldXmin = "held_xmin"

func benchHeldXmin(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	// autovacuum on with a short naptime: what a busy production server
	// would do for the outbox within a round.
	settings := []string{"autovacuum=on", "autovacuum_naptime=1s"}
	srv, err := pipelinetest.StartPostgres(ctx, settings...)
	if err != nil {
		return benchReport{}, fmt.Errorf("starting a PostgreSQL server of the scenario's own: %w", err)
	}
	defer func() { _ = srv.Stop() }()
	url := srv.URL("postgres")
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: url, ApplicationName: "ferry-bench", MaxConns: 8})
	if err != nil {
		return benchReport{}, err
	}
	defer pool.Close()
	db := pgdb.SQLDB(pool)
	defer db.Close()
	if _, err := migrations.Up(ctx, db); err != nil {
		return benchReport{}, err
	}
	if _, err := pool.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pgstattuple`); err != nil {
		return benchReport{}, fmt.Errorf("pgstattuple (postgresql-contrib): %w", err)
	}
	br, err := newBenchBroker(cfg, benchTopic)
	if err != nil {
		return benchReport{}, err
	}
	defer br.close()
	pub, err := rabbit.NewBatchPublisher(br.conn, br.topo)
	if err != nil {
		return benchReport{}, err
	}
	defer pub.Close()

	type round struct {
		Round        int     `json:"round"`
		EventsPerSec float64 `json:"events_per_sec"`
		DeadTuples   int64   `json:"dead_tuples"`
		// PositionDead are the dead versions of the relay's position row
		// (one per batch that moved it).
		PositionDead int64 `json:"position_dead_tuples"`
	}
	runMode := func(held bool) ([]round, error) {
		if _, err := pool.Exec(ctx, `TRUNCATE outbox RESTART IDENTITY`); err != nil {
			return nil, err
		}
		if held {
			// The horizon held from before the first round to after the
			// last: a snapshot with an xid, as a long report has.
			conn, err := pgx.Connect(ctx, url)
			if err != nil {
				return nil, err
			}
			defer conn.Close(context.WithoutCancel(ctx))
			tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
			if err != nil {
				return nil, err
			}
			defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
			if _, err := tx.Exec(ctx, `SELECT txid_current(), count(*) FROM pg_class`); err != nil {
				return nil, err
			}
		}
		var rounds []round
		for r := 1; r <= bc.HeldXminRounds; r++ {
			if _, err := pool.Exec(ctx, insertEventsSQL, benchTopic, bc.HeldXminEvents); err != nil {
				return nil, err
			}
			relay, err := pgoutbox.NewRelay(pool, pub, pgoutbox.RelayConfig{BatchSize: bc.BatchSize, PollInterval: 20 * time.Millisecond, PollOnly: true, FailoverReplay: -1}, logger)
			if err != nil {
				return nil, err
			}
			rctx, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			start := time.Now()
			go func() { _ = relay.Run(rctx); close(done) }()
			for relay.Stats().Dispatched < int64(bc.HeldXminEvents) && ctx.Err() == nil && time.Since(start) < 10*time.Minute {
				time.Sleep(2 * time.Millisecond)
			}
			secs := time.Since(start).Seconds()
			cancel()
			<-done
			if got := relay.Stats().Dispatched; got < int64(bc.HeldXminEvents) {
				return nil, fmt.Errorf("round %d: the relay dispatched %d of %d events", r, got, bc.HeldXminEvents)
			}
			var dead, posDead int64
			if err := pool.QueryRow(ctx, `SELECT (SELECT dead_tuple_count FROM pgstattuple('outbox')), (SELECT dead_tuple_count FROM pgstattuple('`+pgoutbox.PositionTable+`'))`).Scan(&dead, &posDead); err != nil {
				return nil, err
			}
			rounds = append(rounds, round{Round: r, EventsPerSec: float64(bc.HeldXminEvents) / secs, DeadTuples: dead, PositionDead: posDead})
			if err := br.purge(); err != nil {
				return nil, err
			}
		}
		return rounds, nil
	}
	free, err := runMode(false)
	if err != nil {
		return benchReport{}, fmt.Errorf("rounds without a long transaction: %w", err)
	}
	held, err := runMode(true)
	if err != nil {
		return benchReport{}, fmt.Errorf("rounds with a long transaction: %w", err)
	}
	ratio := func(rs []round) float64 { return rs[len(rs)-1].EventsPerSec / rs[0].EventsPerSec }
	deadPerEvent := float64(held[len(held)-1].DeadTuples) / float64(bc.HeldXminEvents*bc.HeldXminRounds)
	rep := benchReport{JSON: map[string]any{
		"events_per_round":      bc.HeldXminEvents,
		"rounds":                bc.HeldXminRounds,
		"server_settings":       append([]string{"fsync=off"}, settings...),
		"without_long_tx":       free,
		"with_long_tx":          held,
		"last_over_first_free":  ratio(free),
		"last_over_first_held":  ratio(held),
		"dead_tuples_per_event": deadPerEvent,
		"goal_dead_per_event":   0,
		"goal_last_over_first":  0.9,
		"goal_met":              ratio(held) >= 0.9 && deadPerEvent == 0,
	}}
	var b strings.Builder
	fmt.Fprintf(&b, "%d rounds of %d events, own server (autovacuum on, naptime 1s, fsync off):\n  round   free ev/s   dead     held ev/s   dead (outbox)   dead (position row)\n", bc.HeldXminRounds, bc.HeldXminEvents)
	for i := range free {
		fmt.Fprintf(&b, "  %5d   %9.0f   %7d  %9.0f   %7d         %7d\n", i+1, free[i].EventsPerSec, free[i].DeadTuples, held[i].EventsPerSec, held[i].DeadTuples, held[i].PositionDead)
	}
	fmt.Fprintf(&b, "  last/first: %.2f free, %.2f with the horizon held (goal ≥ 0.9); %.2f dead outbox tuples per event left behind (goal: none)\n", ratio(free), ratio(held), deadPerEvent)
	rep.Table = b.String()
	return rep, nil
}

// ScenarioHeldXminSteady is the ordinary day beside a long transaction: a
// steady producer (--rate, for --duration) through the whole app (relay,
// consumer) on a PostgreSQL server of its own with autovacuum on, first
// with nothing holding the horizon, then with one REPEATABLE READ
// transaction open the whole run. The relay must keep up, and commit →
// broker confirm p99 stay within twice the run without.
const ScenarioHeldXminSteady = "held_xmin_steady"

func benchHeldXminSteady(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	settings := []string{"autovacuum=on", "autovacuum_naptime=1s"}
	srv, err := pipelinetest.StartPostgres(ctx, settings...)
	if err != nil {
		return benchReport{}, fmt.Errorf("starting a PostgreSQL server of the scenario's own: %w", err)
	}
	defer func() { _ = srv.Stop() }()
	c := cfg
	c.DatabaseURL = srv.URL("postgres")
	// The long transaction opens once the app runs (its migrations build
	// indexes CONCURRENTLY, which wait for older transactions) and stays
	// open until the run has drained.
	hold := func(ctx context.Context) (func(), error) {
		conn, err := pgx.Connect(ctx, c.DatabaseURL)
		if err != nil {
			return nil, err
		}
		release := func() { _ = conn.Close(context.WithoutCancel(ctx)) }
		tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		if err == nil {
			_, err = tx.Exec(ctx, `SELECT txid_current(), count(*) FROM pg_class`)
		}
		if err != nil {
			release()
			return nil, err
		}
		return release, nil
	}
	run := func(held bool) (benchReport, error) {
		h := e2eHooks{publish: benchPublishOne}
		if held {
			h.afterStart = hold
		}
		return endToEnd(ctx, c, bc, app.RelayModeNotify, false, logger, h)
	}
	free, err := run(false)
	if err != nil {
		return benchReport{}, fmt.Errorf("without a long transaction: %w", err)
	}
	settle(ctx, c)
	held, err := run(true)
	if err != nil {
		return benchReport{}, fmt.Errorf("with a long transaction: %w", err)
	}
	p99 := func(r benchReport) float64 {
		s, _ := r.JSON["commit_to_confirm"].(map[string]float64)
		return s["p99_ms"]
	}
	confirmed := func(r benchReport) float64 {
		s, _ := r.JSON["commit_to_confirm"].(map[string]float64)
		return s["count"]
	}
	total := float64(int(float64(bc.Rate) * bc.Duration.Seconds()))
	ratio := p99(held) / max(p99(free), 0.001)
	keptUp := confirmed(held) == total && confirmed(free) == total
	rep := benchReport{JSON: map[string]any{
		"server_settings":             append([]string{"fsync=off"}, settings...),
		"without_long_tx":             free.JSON,
		"with_long_tx":                held.JSON,
		"commit_to_confirm_p99_ratio": ratio,
		"kept_up":                     keptUp,
		"goal_p99_ratio_max":          2.0,
		"goal_met":                    keptUp && ratio <= 2,
	}}
	rep.Table = fmt.Sprintf("own server (autovacuum on, naptime 1s, fsync off), %d/s for %s:\nwithout a long transaction: %swith one open the whole run: %scommit→confirm p99 %.2f ms with it, %.2f ms without: %.2f× (goal ≤ 2); every event confirmed: %v\n",
		bc.Rate, bc.Duration, free.Table, held.Table, p99(held), p99(free), ratio, keptUp)
	return rep, nil
}
