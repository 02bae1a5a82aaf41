// Package backfill is the third way to adopt Ferry in a service that
// already runs: write intents for rows the legacy system never handled
// (the article's "welcome mails for the last 7 days that were never
// sent"), carefully. A careless backfill mails weeks of users at once, so:
//
//   - the query runs in a READ ONLY transaction and is read whole before
//     anything is written; it must return aggregate_id and payload, and
//     may return headers (a JSON object of strings);
//   - a dry run is the default: it writes nothing and says how many
//     intents would be written, shows samples, how many an earlier run of
//     the same name wrote, and the send schedule;
//   - Max (1,000 by default) refuses a query that returns more;
//   - Spread or Rate schedules the intents (available_at) over a window;
//   - a name identifies the backfill: one row per (name, topic, aggregate)
//     in ferry_backfill_items is written in the same transaction as its
//     intent, so re-running writes no intent twice and an interrupted run
//     continues where it stopped.
package backfill

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/evolve"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// Defaults and bounds.
const (
	DefaultMax       = 1000
	DefaultBatchSize = 200
	SampleSize       = 3
	// ItemsTable records what each backfill wrote (migration 00012).
	ItemsTable = "ferry_backfill_items"
	// MetaBackfill names the backfill on every intent it writes.
	MetaBackfill = pipeline.MetaBackfill
)

// Options describe one backfill run.
type Options struct {
	// Name identifies the backfill, for dedup and resume. Required.
	Name string
	// Topic is the intents' topic. Required.
	Topic string
	// Query returns aggregate_id (text), payload (json, jsonb or text
	// holding JSON) and optionally headers (a JSON object of strings).
	// It runs read-only. Required.
	Query string
	// Apply writes the intents; without it the run is a dry run.
	Apply bool
	// Max refuses a query that returns more rows. Default 1,000.
	Max int
	// Spread schedules the intents evenly over this window from now; Rate
	// (per second) is the alternative. Neither: all due now.
	Spread time.Duration
	Rate   float64
	// BatchSize is how many intents one transaction writes. Default 200.
	BatchSize int
	// Progress, if set, is told after every committed batch.
	Progress func(Progress)
	// Event, if set, is the topic's event type (app.Options.Events): the
	// intents are stamped with its current version (unless a row's headers
	// name a schema_version), and a row whose payload does not decode
	// through it refuses the run, dry or not, before anything is written.
	// Default: schema_version "1", payloads only checked to be JSON.
	Event evolve.Schema
}

// Progress is how far an applying run has come.
type Progress struct {
	Written, ToWrite int
	Elapsed          time.Duration
}

// Sample is one intent a run would write.
type Sample struct {
	AggregateID string            `json:"aggregate_id"`
	Payload     json.RawMessage   `json:"payload"`
	Headers     map[string]string `json:"headers,omitempty"`
	AvailableAt time.Time         `json:"available_at"`
}

// Summary says what a run did or, dry, would do.
type Summary struct {
	Name   string `json:"name"`
	Topic  string `json:"topic"`
	DryRun bool   `json:"dry_run"`
	// Rows is how many rows the query returned.
	Rows int `json:"rows"`
	// AlreadyWritten is how many of them earlier runs of this name wrote.
	AlreadyWritten int `json:"already_written"`
	// PreviousRuns is everything this name wrote before, on this topic.
	PreviousRuns int `json:"previously_written_total"`
	// ToWrite is how many intents this run writes (or would).
	ToWrite int `json:"to_write"`
	// Written is how many it wrote (0 for a dry run).
	Written int `json:"written"`
	// FirstAt and LastAt bracket the schedule of the intents to write.
	FirstAt *time.Time `json:"first_at,omitempty"`
	LastAt  *time.Time `json:"last_at,omitempty"`
	Samples []Sample   `json:"samples"`
}

// ErrTooMany is returned when the query returns more than Max rows.
var ErrTooMany = errors.New("the query returns more rows than --max allows")

type row struct {
	aggregate string
	payload   json.RawMessage
	headers   map[string]string
}

// Run runs (or, without Apply, rehearses) a backfill. Every row is
// checked before anything is written; a bad row fails the run, naming it.
func Run(ctx context.Context, pool *pgxpool.Pool, outbox *pgoutbox.Outbox, o Options) (Summary, error) {
	sum := Summary{Name: o.Name, Topic: o.Topic, DryRun: !o.Apply, Samples: []Sample{}}
	if err := o.validate(); err != nil {
		return sum, err
	}
	if o.Max == 0 {
		o.Max = DefaultMax
	}
	if o.BatchSize == 0 {
		o.BatchSize = DefaultBatchSize
	}
	rows, total, err := read(ctx, pool, o)
	if err != nil {
		return sum, err
	}
	sum.Rows = total
	if total > o.Max {
		return sum, fmt.Errorf("%w: %d rows, --max %d (raise it on purpose)", ErrTooMany, total, o.Max)
	}
	done, err := written(ctx, pool, o.Name, o.Topic)
	if err != nil {
		return sum, err
	}
	sum.PreviousRuns = len(done)
	var todo []row
	for _, r := range rows {
		if done[r.aggregate] {
			sum.AlreadyWritten++
			continue
		}
		todo = append(todo, r)
	}
	sum.ToWrite = len(todo)
	var now time.Time
	if err := pool.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
		return sum, err
	}
	at := func(i int) time.Time {
		switch {
		case o.Spread > 0 && len(todo) > 1:
			return now.Add(time.Duration(float64(o.Spread) * float64(i) / float64(len(todo)-1)))
		case o.Rate > 0:
			return now.Add(time.Duration(float64(i) / o.Rate * float64(time.Second)))
		}
		return now
	}
	if len(todo) > 0 {
		first, last := at(0), at(len(todo)-1)
		sum.FirstAt, sum.LastAt = &first, &last
	}
	for i, r := range todo {
		if i == SampleSize {
			break
		}
		sum.Samples = append(sum.Samples, Sample{AggregateID: r.aggregate, Payload: r.payload, Headers: r.headers, AvailableAt: at(i)})
	}
	if !o.Apply {
		return sum, nil
	}
	start := time.Now()
	for lo := 0; lo < len(todo); lo += o.BatchSize {
		hi := min(lo+o.BatchSize, len(todo))
		n, err := writeBatch(ctx, pool, outbox, o, todo[lo:hi], lo, at)
		sum.Written += n
		if err != nil {
			return sum, fmt.Errorf("writing intents (%d written, the rest resume on the next run): %w", sum.Written, err)
		}
		if o.Progress != nil {
			o.Progress(Progress{Written: sum.Written, ToWrite: sum.ToWrite, Elapsed: time.Since(start)})
		}
	}
	return sum, nil
}

func (o Options) validate() error {
	var errs []error
	if strings.TrimSpace(o.Name) == "" || len(o.Name) > 200 || !utf8.ValidString(o.Name) {
		errs = append(errs, errors.New("--name is required (at most 200 bytes)"))
	}
	if o.Topic == "" {
		errs = append(errs, errors.New("--topic is required"))
	} else if err := pipeline.ValidateTopicName(o.Topic); err != nil {
		errs = append(errs, fmt.Errorf("--topic: %w", err))
	}
	if strings.TrimSpace(o.Query) == "" {
		errs = append(errs, errors.New("a query is required (--query or --query-file)"))
	}
	if o.Max < 0 {
		errs = append(errs, errors.New("--max must be positive"))
	}
	if o.Spread < 0 || o.Rate < 0 {
		errs = append(errs, errors.New("--spread and --rate must not be negative"))
	}
	if o.Spread > 0 && o.Rate > 0 {
		errs = append(errs, errors.New("give --spread or --rate, not both"))
	}
	if o.BatchSize < 0 {
		errs = append(errs, errors.New("the batch size must be positive"))
	}
	return errors.Join(errs...)
}

// read runs the query read-only and checks every row.
func read(ctx context.Context, pool *pgxpool.Pool, o Options) ([]row, int, error) {
	var out []row
	total := 0
	err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		// The extended protocol, whatever the connection's default (a
		// PgBouncer URL often says default_query_exec_mode=simple_protocol):
		// it takes exactly one statement, so "COMMIT; DELETE ..." cannot
		// end the read-only transaction and write outside it.
		rows, err := tx.Query(ctx, o.Query, pgx.QueryExecModeExec)
		if err != nil {
			return fmt.Errorf("running the query: %w", err)
		}
		defer rows.Close()
		cols := map[string]int{}
		for i, f := range rows.FieldDescriptions() {
			cols[f.Name] = i
		}
		ai, aok := cols["aggregate_id"]
		pi, pok := cols["payload"]
		hi, hok := cols["headers"]
		if !aok || !pok {
			rows.Close()
			if err := rows.Err(); err != nil {
				return fmt.Errorf("running the query (read-only): %w", err)
			}
			return errors.New("the query must return the columns aggregate_id and payload (and optionally headers)")
		}
		seen := map[string]bool{}
		for n := 1; rows.Next(); n++ {
			total++
			if total > o.Max {
				continue // counted, not kept: the run is refused anyway
			}
			vals, err := rows.Values()
			if err != nil {
				return fmt.Errorf("row %d: %w", n, err)
			}
			r, err := toRow(vals[ai], vals[pi], hok, func() any { return vals[hi] })
			if err != nil {
				return fmt.Errorf("row %d: %w", n, err)
			}
			if seen[r.aggregate] {
				return fmt.Errorf("row %d: aggregate_id %q appears twice: one intent per aggregate", n, r.aggregate)
			}
			if o.Event != nil {
				v := cmp.Or(r.headers[pipeline.MetaSchemaVersion], o.Event.Current())
				if err := o.Event.Verify(v, r.payload); err != nil {
					return fmt.Errorf("row %d (aggregate %s): the payload is not an event its handler reads: %w", n, r.aggregate, err)
				}
			}
			seen[r.aggregate] = true
			out = append(out, r)
		}
		return rows.Err()
	})
	return out, total, err
}

func toRow(agg, payload any, hasHeaders bool, headers func() any) (row, error) {
	var r row
	switch a := agg.(type) {
	case string:
		r.aggregate = a
	case int64, int32, int16:
		r.aggregate = fmt.Sprint(a)
	default:
		return r, fmt.Errorf("aggregate_id must be text or an integer, got %T", agg)
	}
	if r.aggregate == "" {
		return r, errors.New("aggregate_id is empty")
	}
	var raw []byte
	switch p := payload.(type) {
	case string:
		raw = []byte(p)
	case []byte:
		raw = p
	case nil:
		return r, errors.New("payload is NULL")
	default: // json/jsonb decode to maps and slices
		b, err := json.Marshal(p)
		if err != nil {
			return r, fmt.Errorf("payload: %w", err)
		}
		raw = b
	}
	if !json.Valid(raw) {
		return r, errors.New("payload is not JSON")
	}
	r.payload = raw
	if hasHeaders {
		switch h := headers().(type) {
		case nil:
		case map[string]any:
			r.headers = map[string]string{}
			for k, v := range h {
				s, ok := v.(string)
				switch {
				case !ok:
					return r, fmt.Errorf("header %q is not a string", k)
				case k == MetaBackfill || pipeline.ReservedMetadata(k):
					// Refused here, in the dry run too, not by the
					// outbox after earlier batches were written.
					return r, fmt.Errorf("header %q is reserved for Ferry: %w", k, pipeline.ErrReservedMetadata)
				case strings.HasPrefix(k, "ferry_"):
					// The outbox's instructions (ferry_topic, ferry_delay,
					// ferry_deliver_at) would silently override what the
					// operator asked for.
					return r, fmt.Errorf("header %q would override the backfill's --topic, --spread or --rate; the query cannot set it: %w", k, pipeline.ErrReservedMetadata)
				case !pipeline.ValidText(k) || !pipeline.ValidText(s):
					return r, fmt.Errorf("header %q must be valid UTF-8 without NUL", pipeline.CleanText(k, 100))
				}
				r.headers[k] = s
			}
		default:
			return r, fmt.Errorf("headers must be a JSON object of strings, got %T", h)
		}
	}
	return r, nil
}

func written(ctx context.Context, pool *pgxpool.Pool, name, topic string) (map[string]bool, error) {
	rows, err := pool.Query(ctx, `SELECT aggregate_id FROM `+ItemsTable+` WHERE name = $1 AND topic = $2`, name, topic)
	if err != nil {
		return nil, fmt.Errorf("reading earlier runs of %q: %w", name, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	out := make(map[string]bool, len(ids))
	for _, id := range ids {
		out[id] = true
	}
	return out, nil
}

// writeBatch writes one batch of intents with their item rows. An item a
// concurrent run wrote meanwhile is skipped (its row exists), so two runs
// of one name never double an intent.
func writeBatch(ctx context.Context, pool *pgxpool.Pool, outbox *pgoutbox.Outbox, o Options, batch []row, offset int, at func(int) time.Time) (int, error) {
	n := 0
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		n = 0
		for i, r := range batch {
			id := watermill.NewUUID()
			when := at(offset + i)
			tag, err := tx.Exec(ctx, `INSERT INTO `+ItemsTable+` (name, topic, aggregate_id, message_uuid, available_at)
				VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING`, o.Name, o.Topic, r.aggregate, id, when)
			if err != nil {
				return err
			}
			if tag.RowsAffected() == 0 {
				continue
			}
			msg := message.NewMessage(id, message.Payload(r.payload))
			msg.Metadata.Set(pipeline.MetaSchemaVersion, pipeline.DefaultSchemaVersion)
			if o.Event != nil {
				msg.Metadata.Set(pipeline.MetaSchemaVersion, o.Event.Current())
			}
			for k, v := range r.headers {
				msg.Metadata.Set(k, v)
			}
			msg.Metadata.Set(pipeline.MetaAggregateID, r.aggregate)
			msg.Metadata.Set(MetaBackfill, o.Name)
			pipeline.WithDeliverAt(msg, when)
			if err := outbox.PublishTx(ctx, pgoutbox.PgxTx(tx), o.Topic, msg); err != nil {
				return fmt.Errorf("aggregate %s: %w", r.aggregate, err)
			}
			n++
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	return n, nil
}
