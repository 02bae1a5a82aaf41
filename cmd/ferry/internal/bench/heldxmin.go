package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/migrations"
	"github.com/ferry-dev/ferry/pipeline/pgcdc"
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

// outboxDeadSQL counts the dead row versions in the outbox's partitions.
var outboxDeadSQL = `SELECT sum((pgstattuple(inhrelid)).dead_tuple_count) FROM pg_inherits WHERE inhparent = '` + outboxSQL + `'::regclass`

func benchHeldXmin(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	// autovacuum on with a short naptime: what a busy production server
	// would do for the outbox within a round.
	settings := []string{"autovacuum=on", "autovacuum_naptime=1s"}
	// --relay-mode cdc adds the CDC relay's rounds, after the polling
	// relay's, in the same run: it still marks each row it sends.
	withCDC := slices.Contains(bc.RelayModes, app.RelayModeCDC)
	if withCDC {
		settings = append(settings, "wal_level=logical")
	}
	settings = append(settings, bc.ServerSettings...)
	srv, stop, err := startOwnServer(ctx, bc, ScenarioHeldXmin, settings, logger)
	if err != nil {
		return benchReport{}, err
	}
	defer stop()
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
	// Retention with the horizon held: a week's rows past retention go by
	// TRUNCATE of their partition; the legacy partition's (the outbox of
	// before migration 00025) by DELETE, as every row went before.
	type retention struct {
		Rows               int     `json:"rows_each"`
		TruncateSeconds    float64 `json:"truncate_seconds"`
		TruncateDeadTuples int64   `json:"truncate_dead_tuples"`
		DeleteSeconds      float64 `json:"delete_seconds"`
		DeleteDeadTuples   int64   `json:"delete_dead_tuples"`
	}
	var ret retention
	measureRetention := func() error {
		n := bc.HeldXminEvents
		// A week six weeks ago, and legacy rows of 40 days ago beside one
		// of today (so that the legacy partition is pruned row by row).
		if _, err := pool.Exec(ctx, `INSERT INTO `+outboxSQL+` (aggregate_id, topic, payload, created_at, dispatched_at, part)
			SELECT 'r-' || g % 100, $1, '{}'::jsonb, now() - interval '42 days', now() - interval '42 days', ferry_outbox_part(now() - interval '42 days')
			FROM generate_series(1, $2) g
			UNION ALL SELECT 'l-' || g % 100, $1, '{}', now() - interval '40 days', now() - interval '40 days', -1 FROM generate_series(1, $2) g
			UNION ALL SELECT 'l-today', $1, '{}', now(), now(), -1`, benchTopic, n); err != nil {
			return err
		}
		var week string
		if err := pool.QueryRow(ctx, `SELECT 'outbox_p' || lpad(ferry_outbox_part(now() - interval '42 days')::text, 2, '0')`).Scan(&week); err != nil {
			return err
		}
		var cutoff time.Time
		if err := pool.QueryRow(ctx, `SELECT now() - interval '30 days'`).Scan(&cutoff); err != nil {
			return err
		}
		start := time.Now()
		cleared, err := pgoutbox.Table{}.ClearPartitions(ctx, pool, cutoff, false, false)
		if err != nil {
			return err
		}
		ret.TruncateSeconds = time.Since(start).Seconds()
		if len(cleared.Partitions) != 1 || cleared.Rows != int64(n) {
			return fmt.Errorf("retention: cleared %v (%d rows), want %s (%d rows)", cleared.Partitions, cleared.Rows, week, n)
		}
		start = time.Now()
		var deleted int64
		for {
			d, err := pgoutbox.Table{}.DeleteDispatchedBefore(ctx, pool, cutoff, 10_000, false)
			if err != nil {
				return err
			}
			deleted += d
			if d < 10_000 {
				break
			}
		}
		ret.DeleteSeconds = time.Since(start).Seconds()
		if deleted != int64(n) {
			return fmt.Errorf("retention: deleted %d legacy rows, want %d", deleted, n)
		}
		ret.Rows = n
		return pool.QueryRow(ctx, `SELECT (pgstattuple($1)).dead_tuple_count, (pgstattuple('outbox_legacy')).dead_tuple_count`, week).Scan(&ret.TruncateDeadTuples, &ret.DeleteDeadTuples)
	}
	// The CDC rounds' slot, made before any long transaction is opened
	// (creating a logical slot waits for the transactions in progress).
	slot := fmt.Sprintf("ferry_bench_%d", time.Now().UnixNano())
	cdcCfg := pgcdc.Config{Slot: slot, BatchSize: max(bc.BatchSize, pgcdc.DefaultBatchSize)}
	cdcRelay, err := pgoutbox.NewRelay(pool, pub, pgoutbox.RelayConfig{BatchSize: bc.BatchSize, FailoverReplay: -1}, logger)
	if err != nil {
		return benchReport{}, err
	}
	// drainCDC streams the round's rows with a streamer of its own (the
	// slot stays between rounds) until n are dispatched.
	drainCDC := func(n int) (time.Duration, error) {
		start := time.Now()
		st, stop, err := startStreamer(ctx, pool, cdcRelay, cdcCfg, logger)
		if err != nil {
			return 0, err
		}
		defer stop()
		for st.Stats().Dispatched < int64(n) {
			if ctx.Err() != nil || time.Since(start) > 10*time.Minute {
				return 0, fmt.Errorf("the CDC relay dispatched %d of %d events", st.Stats().Dispatched, n)
			}
			time.Sleep(2 * time.Millisecond)
		}
		return time.Since(start), nil
	}
	if withCDC {
		defer func() {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			_, _, _ = pgcdc.DropWhenInactive(dctx, pool, slot, slot)
		}()
		if _, err := drainCDC(0); err != nil { // creates the slot
			return benchReport{}, err
		}
	}
	runMode := func(held, cdc bool) ([]round, error) {
		if _, err := pool.Exec(ctx, `TRUNCATE `+outboxSQL+` RESTART IDENTITY`); err != nil {
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
			if cdc {
				took, err := drainCDC(bc.HeldXminEvents)
				if err != nil {
					return nil, fmt.Errorf("round %d: %w", r, err)
				}
				var dead int64
				if err := pool.QueryRow(ctx, outboxDeadSQL).Scan(&dead); err != nil {
					return nil, err
				}
				rounds = append(rounds, round{Round: r, EventsPerSec: float64(bc.HeldXminEvents) / took.Seconds(), DeadTuples: dead})
				if err := br.purge(); err != nil {
					return nil, err
				}
				continue
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
			if err := pool.QueryRow(ctx, `SELECT (`+outboxDeadSQL+`), (SELECT dead_tuple_count FROM pgstattuple('`+pgoutbox.PositionTable+`'))`).Scan(&dead, &posDead); err != nil {
				return nil, err
			}
			rounds = append(rounds, round{Round: r, EventsPerSec: float64(bc.HeldXminEvents) / secs, DeadTuples: dead, PositionDead: posDead})
			if err := br.purge(); err != nil {
				return nil, err
			}
		}
		if held && !cdc {
			if err := measureRetention(); err != nil {
				return nil, err
			}
		}
		return rounds, nil
	}
	free, err := runMode(false, false)
	if err != nil {
		return benchReport{}, fmt.Errorf("rounds without a long transaction: %w", err)
	}
	held, err := runMode(true, false)
	if err != nil {
		return benchReport{}, fmt.Errorf("rounds with a long transaction: %w", err)
	}
	var cdcFree, cdcHeld []round
	if withCDC {
		if cdcFree, err = runMode(false, true); err != nil {
			return benchReport{}, fmt.Errorf("CDC rounds without a long transaction: %w", err)
		}
		if cdcHeld, err = runMode(true, true); err != nil {
			return benchReport{}, fmt.Errorf("CDC rounds with a long transaction: %w", err)
		}
	}
	ratio := func(rs []round) float64 { return rs[len(rs)-1].EventsPerSec / rs[0].EventsPerSec }
	// The last round's count holds every round's: the horizon was held.
	perEvent := func(rs []round) float64 {
		return float64(rs[len(rs)-1].DeadTuples) / float64(bc.HeldXminEvents*bc.HeldXminRounds)
	}
	deadPerEvent := perEvent(held)
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
		"retention_held":        ret,
	}}
	if withCDC {
		rep.JSON["cdc"] = map[string]any{
			"without_long_tx":       cdcFree,
			"with_long_tx":          cdcHeld,
			"last_over_first_free":  ratio(cdcFree),
			"last_over_first_held":  ratio(cdcHeld),
			"dead_tuples_per_event": perEvent(cdcHeld),
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d rounds of %d events, own server (autovacuum on, naptime 1s, fsync off):\n  round   free ev/s   dead     held ev/s   dead (outbox)   dead (position row)\n", bc.HeldXminRounds, bc.HeldXminEvents)
	for i := range free {
		fmt.Fprintf(&b, "  %5d   %9.0f   %7d  %9.0f   %7d         %7d\n", i+1, free[i].EventsPerSec, free[i].DeadTuples, held[i].EventsPerSec, held[i].DeadTuples, held[i].PositionDead)
	}
	fmt.Fprintf(&b, "  last/first: %.2f free, %.2f with the horizon held (goal ≥ 0.9); %.2f dead outbox tuples per event left behind (goal: none)\n", ratio(free), ratio(held), deadPerEvent)
	fmt.Fprintf(&b, "  retention of %d rows past it, horizon held: a week's partition by TRUNCATE %.3f s, %d dead tuples; the legacy partition by DELETE %.3f s, %d dead tuples\n",
		ret.Rows, ret.TruncateSeconds, ret.TruncateDeadTuples, ret.DeleteSeconds, ret.DeleteDeadTuples)
	if withCDC {
		fmt.Fprintf(&b, "the CDC relay (no safety net running), same rounds:\n  round   free ev/s   dead     held ev/s   dead (outbox)\n")
		for i := range cdcFree {
			fmt.Fprintf(&b, "  %5d   %9.0f   %7d  %9.0f   %7d\n", i+1, cdcFree[i].EventsPerSec, cdcFree[i].DeadTuples, cdcHeld[i].EventsPerSec, cdcHeld[i].DeadTuples)
		}
		fmt.Fprintf(&b, "  last/first: %.2f free, %.2f held; %.2f dead outbox tuples per event left behind (it marks each row it sends)\n",
			ratio(cdcFree), ratio(cdcHeld), perEvent(cdcHeld))
	}
	rep.Table = b.String()
	return rep, nil
}

// startOwnServer starts the PostgreSQL server of scenario with settings
// (bc.ServerSettings among them). stop stops and removes it, first
// appending its log to bc.ServerLog when that is set: the server's
// directory goes with it.
func startOwnServer(ctx context.Context, bc BenchConfig, scenario string, settings []string, logger *slog.Logger) (*pipelinetest.PostgresServer, func(), error) {
	srv, err := pipelinetest.StartPostgres(ctx, settings...)
	if err != nil {
		return nil, nil, fmt.Errorf("starting a PostgreSQL server of the scenario's own: %w", err)
	}
	stop := func() {
		if bc.ServerLog != "" {
			if err := keepServerLog(srv, bc.ServerLog, scenario, settings); err != nil {
				logger.Error("keeping the scenario's server log", "scenario", scenario, "file", bc.ServerLog, "error", err)
			}
		}
		_ = srv.Stop()
	}
	return srv, stop, nil
}

// keepServerLog appends srv's log to file, under a line naming the
// scenario and the server's settings.
func keepServerLog(srv *pipelinetest.PostgresServer, file, scenario string, settings []string) error {
	log, err := srv.Log()
	if err != nil {
		return err
	}
	f, err := os.OpenFile(file, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(f, "== %s: PostgreSQL server log, settings %s\n%s", scenario, strings.Join(settings, " "), log)
	return errors.Join(err, f.Close())
}

// ScenarioHeldXminSteady is the ordinary day beside a long transaction: a
// steady producer (--rate, for --duration) through the whole app (relay,
// consumer) on a PostgreSQL server of its own with autovacuum on, first
// with nothing holding the horizon, then with one REPEATABLE READ
// transaction open the whole run. The relay must keep up, and commit →
// broker confirm p99 stay within twice the run without.
const ScenarioHeldXminSteady = "held_xmin_steady"

func benchHeldXminSteady(ctx context.Context, cfg app.Config, bc BenchConfig, logger *slog.Logger) (benchReport, error) {
	settings := append([]string{"autovacuum=on", "autovacuum_naptime=1s"}, bc.ServerSettings...)
	srv, stop, err := startOwnServer(ctx, bc, ScenarioHeldXminSteady, settings, logger)
	if err != nil {
		return benchReport{}, err
	}
	defer stop()
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
		h := e2eHooks{publish: benchPublishOne, relayOnly: bc.HeldXminRelayOnly}
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
		"relay_only":                  bc.HeldXminRelayOnly,
		"without_long_tx":             free.JSON,
		"with_long_tx":                held.JSON,
		"commit_to_confirm_p99_ratio": ratio,
		"kept_up":                     keptUp,
		"goal_p99_ratio_max":          2.0,
		"goal_met":                    keptUp && ratio <= 2,
	}}
	what := "the whole app"
	if bc.HeldXminRelayOnly {
		what = "relay only, an auto-ack drain"
	}
	rep.Table = fmt.Sprintf("own server (autovacuum on, naptime 1s, fsync off), %s, %d/s for %s:\nwithout a long transaction: %swith one open the whole run: %scommit→confirm p99 %.2f ms with it, %.2f ms without: %.2f× (goal ≤ 2); every event confirmed: %v\n",
		what, bc.Rate, bc.Duration, free.Table, held.Table, p99(held), p99(free), ratio, keptUp)
	return rep, nil
}
