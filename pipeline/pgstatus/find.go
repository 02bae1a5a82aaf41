package pgstatus

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgparked"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
)

// Sighting is one place a message was found, and what it says there.
type Sighting struct {
	// Store is where: outbox, outbox archive, durable retry, held
	// partition, parked (a tenant fleet's), ledger, poison store, poison
	// archive.
	Store string    `json:"store"`
	At    time.Time `json:"at"`
	// State says what the message is or was doing there.
	State string `json:"state"`
	// Error is the last error or the reason, when there is one.
	Error string `json:"error,omitempty"`
	// ID is the row's id in its store (outbox or poison id), 0 for none.
	ID int64 `json:"id,omitempty"`
	// Consumer names the route or partition, where the store has one.
	Consumer string `json:"consumer,omitempty"`
	// Pending: an outbox row (the event, or a durable retry of it) not
	// sent to the broker yet. Dispatched: one that was.
	Pending    bool `json:"pending,omitempty"`
	Dispatched bool `json:"dispatched,omitempty"`
}

// Trail is one message: what it is, where it is now, and where it was seen.
type Trail struct {
	MessageID     string `json:"message_id"`
	AggregateID   string `json:"aggregate_id"`
	Topic         string `json:"topic"`
	CorrelationID string `json:"correlation_id,omitempty"`
	TraceID       string `json:"trace_id,omitempty"`
	Now           string `json:"now"`
	// WaitingBehind says, of a message at the broker, which pause or held
	// partition of a route that has not handled it keeps it waiting.
	WaitingBehind []Wait     `json:"waiting_behind,omitempty"`
	Sightings     []Sighting `json:"sightings"`
	// atBroker: Now says it was dispatched and seen nowhere after.
	atBroker bool
}

// know fills in what the trail does not know yet of its message.
func (tr *Trail) know(topic, aggregateID, correlationID, traceID string) {
	tr.Topic = cmp.Or(tr.Topic, topic)
	tr.AggregateID = cmp.Or(tr.AggregateID, aggregateID)
	tr.CorrelationID = cmp.Or(tr.CorrelationID, correlationID)
	tr.TraceID = cmp.Or(tr.TraceID, traceID)
}

// Found is what Find found.
type Found struct {
	Query  string  `json:"query"`
	Trails []Trail `json:"messages"`
	// Truncated: more messages matched than the limit (an aggregate with
	// a long history); the newest are shown.
	Truncated bool `json:"truncated"`
	// NotSearched names the stores that could not be searched in time
	// (FindTimeout), with why.
	NotSearched []string `json:"not_searched,omitempty"`
}

// FindTimeout bounds each store's search: the outbox is not indexed by
// message, correlation id or dispatched aggregate (an index would cost
// every producer's insert), so a search there scans, and a large outbox
// answers "not searched" rather than holding a connection.
const FindTimeout = 10 * time.Second

// Find looks q up as a message id, an aggregate id or a correlation id in
// every store Ferry keeps (the outbox and its archive, the durable retries,
// the held partitions, the consumers' ledger, the poison store and its
// archive) and says, for each message found (the newest limit), where it
// is now and what happened to it. routes are the app's route names: the
// ledger is looked up by its key (route, message) when they are given.
// The broker's queues are not searched: RabbitMQ cannot look a message up
// without taking it; a message dispatched and not yet handled is at the
// broker or being handled.
func Find(ctx context.Context, pool *pgxpool.Pool, t pgoutbox.Table, routes []string, q string, limit int) (Found, error) {
	q = strings.TrimSpace(q)
	found := Found{Query: q}
	if q == "" {
		return found, errors.New("find: give a message id, an aggregate id or a correlation id")
	}
	if len(q) > 512 {
		return found, errors.New("find: the query is longer than any id Ferry keeps (512)")
	}
	if limit <= 0 {
		limit = 50
	}
	trails := map[string]*Trail{}
	var order []string
	trail := func(id string) *Trail {
		tr := trails[id]
		if tr == nil {
			tr = &Trail{MessageID: id}
			trails[id] = tr
			order = append(order, id)
		}
		return tr
	}
	inTx := func(store string, read func(tx pgx.Tx) error) error {
		err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SET LOCAL statement_timeout = `+strconv.FormatInt(FindTimeout.Milliseconds(), 10)); err != nil {
				return err
			}
			return read(tx)
		})
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "57014" { // query_canceled: the timeout
			found.NotSearched = append(found.NotSearched, fmt.Sprintf("%s (took longer than %s)", store, FindTimeout))
			return nil
		}
		if err != nil {
			return fmt.Errorf("searching the %s: %w", store, err)
		}
		return nil
	}
	outboxRows := func(store string, archived bool) error {
		return inTx(store, func(tx pgx.Tx) error {
			rows, err := t.Find(ctx, tx, archived, q, limit+1)
			for _, r := range rows {
				outboxSighting(trail, store, r)
			}
			return err
		})
	}
	if err := outboxRows("outbox", false); err != nil {
		return found, err
	}
	if err := outboxRows("outbox archive", true); err != nil {
		return found, err
	}
	poisonRows := func(store string, archived bool) error {
		return inTx(store, func(tx pgx.Tx) error {
			found, err := pgpoison.Search(ctx, tx, archived, q, limit+1)
			for _, p := range found {
				s := Sighting{Store: store, At: p.PoisonedAt, ID: p.ID, Consumer: p.Consumer, Error: pipeline.CleanText(p.Reason, 1000),
					State: "poisoned by " + p.Handler + ": given up on, waiting for an operator (requeue or discard)"}
				if archived {
					s.At = p.DiscardedAt
					s.State = fmt.Sprintf("discarded from the poison store by %s (ferry poison undo --run %s puts it back)", p.DiscardedBy, p.DiscardRun)
				}
				tr := trail(p.MessageID)
				tr.know(p.Topic, p.AggregateID, p.CorrelationID, p.Headers[pipeline.MetaTraceID])
				tr.Sightings = append(tr.Sightings, s)
			}
			return err
		})
	}
	if err := poisonRows("poison store", false); err != nil {
		return found, err
	}
	if err := poisonRows("poison archive", true); err != nil {
		return found, err
	}
	// The ledger and the held partitions are keyed by message: look up
	// every message found so far, and q itself.
	ids := append([]string{q}, order...)
	if err := inTx("held partitions", func(tx pgx.Tx) error {
		held, err := pgheld.ByMessage(ctx, tx, ids)
		for _, h := range held {
			tr := trail(h.MessageID)
			tr.Sightings = append(tr.Sightings, Sighting{Store: "held partition", At: h.Since, Consumer: h.Consumer, Error: pipeline.CleanText(h.LastError, 1000),
				State: fmt.Sprintf("the failing head of partition %s, which waits behind it (next attempt %d)", h.Consumer, h.Attempt)})
		}
		return err
	}); err != nil {
		return found, err
	}
	if err := inTx("parked events", func(tx pgx.Tx) error {
		parked, err := pgparked.ByMessage(ctx, tx, ids)
		for _, e := range parked {
			s := Sighting{Store: "parked", At: e.ParkedAt, Consumer: e.Consumer, Error: pipeline.CleanText(e.Reason, 1000),
				State: fmt.Sprintf("parked out of ordered partition %s while tenant %q's database is out of reach; sent back to it, in order, once it answers", e.Consumer, e.TenantID)}
			if e.SentAt != nil {
				s.State = fmt.Sprintf("parked out of ordered partition %s while tenant %q's database was out of reach; sent back to it %s, not handled yet", e.Consumer, e.TenantID, e.SentAt.UTC().Format(time.RFC3339))
			}
			trail(e.MessageID).Sightings = append(trail(e.MessageID).Sightings, s)
		}
		return err
	}); err != nil {
		return found, err
	}
	if err := inTx("ledger", func(tx pgx.Tx) error {
		handled, err := pgledger.HandledOf(ctx, tx, ids, routes)
		for _, h := range handled {
			tr := trail(h.MessageID)
			tr.Sightings = append(tr.Sightings, Sighting{Store: "ledger", At: h.ProcessedAt, Consumer: h.Consumer, State: "handled by " + h.Consumer})
		}
		return err
	}); err != nil {
		return found, err
	}
	for _, id := range order {
		tr := trails[id]
		if len(tr.Sightings) == 1 && tr.Sightings[0].Store == "ledger" && id != q {
			continue
		}
		slices.SortStableFunc(tr.Sightings, func(a, b Sighting) int { return a.At.Compare(b.At) })
		tr.Now, tr.atBroker = now(tr)
		found.Trails = append(found.Trails, *tr)
	}
	behindHolds(found.Trails)
	if err := inTx("pauses and held partitions", func(tx pgx.Tx) error {
		w, err := readWaits(ctx, tx)
		if err == nil {
			for i := range found.Trails {
				w.explain(&found.Trails[i])
			}
		}
		return err
	}); err != nil {
		return found, err
	}
	if len(found.Trails) > limit {
		found.Trails, found.Truncated = found.Trails[:limit], true
	}
	return found, nil
}

// now says where a message is, from where it was seen: the most telling
// place first (a hold or the poison store outranks an old dispatch), and
// whether that is "at the broker" (dispatched, seen nowhere after).
func now(tr *Trail) (string, bool) {
	var handled []string
	for _, s := range tr.Sightings {
		switch s.Store {
		case "held partition":
			return "holding its partition: " + s.State, false
		case "parked":
			return s.State, false
		case "poison store":
			return "in the poison store: " + s.State, false
		case "ledger":
			handled = append(handled, s.Consumer)
		}
	}
	for i := len(tr.Sightings) - 1; i >= 0; i-- {
		if s := tr.Sightings[i]; s.Pending {
			return s.State, false
		}
	}
	if len(handled) > 0 {
		return "handled by " + strings.Join(handled, ", "), false
	}
	if len(tr.Sightings) == 0 {
		return "not found", false
	}
	last := tr.Sightings[len(tr.Sightings)-1]
	if last.Dispatched {
		return "at the broker or being handled (" + last.State + "; the broker's queues are not searched: RabbitMQ cannot look a message up without taking it)", true
	}
	return last.State, false
}

// behindHolds says of a message dispatched after a held head of its
// aggregate and topic that it waits behind that head: an ordered topic
// puts one aggregate's messages on one partition, and the hold is the
// partition's.
func behindHolds(trails []Trail) {
	type key struct{ agg, topic string }
	type hold struct {
		msg, consumer string
		at            time.Time
	}
	holds := map[key]hold{}
	for _, tr := range trails {
		for _, s := range tr.Sightings {
			if s.Store == "held partition" {
				holds[key{tr.AggregateID, tr.Topic}] = hold{msg: tr.MessageID, consumer: s.Consumer, at: tr.Sightings[0].At}
			}
		}
	}
	for i := range trails {
		tr := &trails[i]
		h, ok := holds[key{tr.AggregateID, tr.Topic}]
		if !ok || h.msg == tr.MessageID || !tr.atBroker || tr.Sightings[0].At.Before(h.at) {
			continue
		}
		tr.Now = fmt.Sprintf("waiting at the broker behind the held head %s of partition %s (the same aggregate's messages are handled in order)", h.msg, h.consumer)
	}
}

// outboxSighting records where outbox row r (of store: the outbox or its
// archive) shows the message it carries.
func outboxSighting(trail func(id string) *Trail, store string, r pgoutbox.Row) {
	done, headers := r.Dispatched, r.Headers
	msgID, eventTopic := r.MessageID, r.Topic
	s := Sighting{Store: store, At: r.CreatedAt, ID: r.ID, Error: pipeline.CleanText(r.LastError, 1000), Pending: !done, Dispatched: done}
	sent := "sent to the broker"
	if r.DispatchedAt != nil {
		sent += " at " + r.DispatchedAt.UTC().Format(time.RFC3339)
	}
	switch {
	case r.Topic == pipeline.RetryTopic:
		eventTopic = "" // the retry's, not the event's
		// A durable retry carries the original message's id.
		if orig := headers[pipeline.MetaMessageID]; orig != "" {
			msgID = orig
		}
		s.Store, s.Consumer = "durable retry", headers[pipeline.MetaRetryQueue]
		s.Error = pipeline.CleanText(headers[pipeline.MetaLastError], 1000)
		attempt := headers[pipeline.MetaAttempt]
		if !done {
			s.State = fmt.Sprintf("waiting to be retried by %s (attempt %s) at %s", s.Consumer, attempt, r.AvailableAt.UTC().Format(time.RFC3339))
		} else {
			s.State = fmt.Sprintf("retry for %s (attempt %s) %s", s.Consumer, attempt, sent)
		}
	case !done:
		s.State = "in the outbox, not dispatched yet"
		if r.Attempts > 0 {
			s.State = fmt.Sprintf("in the outbox, not dispatched yet: %d failed attempt(s), next at %s", r.Attempts, r.AvailableAt.UTC().Format(time.RFC3339))
		} else if r.AvailableAt.After(time.Now()) {
			s.State = "in the outbox, delayed until " + r.AvailableAt.UTC().Format(time.RFC3339)
		}
	default:
		s.State = "dispatched: " + sent
	}
	tr := trail(msgID)
	tr.know(eventTopic, r.AggregateID, headers[pipeline.MetaCorrelationID], headers[pipeline.MetaTraceID])
	tr.Sightings = append(tr.Sightings, s)
}
