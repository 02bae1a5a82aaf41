package ordersapp_test

import (
	"context"
	"errors"
	"fmt"
	"html"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgbudget"
	"github.com/ferry-dev/ferry/pipeline/pgheld"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

type job struct {
	N int `json:"n"`
}

// counting returns a route whose handler fails while fail() says so and
// counts the successful runs per message id.
func counting(name, topic string, fail func(*message.Message) error, done *sync.Map) handlers.Route {
	return handlers.Route{Name: name, Topic: topic, Handler: func(msg *message.Message) error {
		if err := fail(msg); err != nil {
			return err
		}
		n, _ := done.LoadOrStore(pipeline.MessageID(msg), new(atomic.Int32))
		n.(*atomic.Int32).Add(1)
		return nil
	}}
}

func runs(done *sync.Map) (messages, total int) {
	done.Range(func(_, v any) bool {
		messages++
		total += int(v.(*atomic.Int32).Load())
		return true
	})
	return messages, total
}

// A failed message waits for its durable retry in the outbox, not in the
// consumer: a consumer restarted meanwhile gets it, once.
func TestDurableRetrySurvivesConsumerRestart(t *testing.T) {
	t.Parallel()
	cfg, provider, sink := testConfig(t)
	cfg.DurableRetry.Backoff = pipeline.Backoff{Initial: 4 * time.Second, Max: 5 * time.Second, Jitter: -1}
	var failing atomic.Bool
	failing.Store(true)
	var done sync.Map
	var attempts sync.Map
	routes := app.Options{Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{counting("retry.worker", "work.retry", func(m *message.Message) error {
			attempts.Store(pipeline.DeliveryAttempt(m), true)
			if failing.Load() {
				return errors.New("dependency down")
			}
			return nil
		}, &done)}, nil
	}}
	first := startWith(t, cfg, provider, sink, routes, app.Components{Relay: true, Consumers: true})
	publishEvent(t, first, "work.retry", "job-1", job{N: 1})

	var retryDue time.Time
	eventually(t, "the durable retry scheduled", func() bool {
		err := first.app.Pool().QueryRow(context.Background(),
			`SELECT available_at FROM `+pgoutbox.Table{}.View(pgoutbox.StatePending)+` o WHERE topic = $1`, pipeline.RetryTopic).Scan(&retryDue)
		return err == nil
	})
	first.stop() // the consumer goes away while the retry waits
	require.True(t, time.Until(retryDue) > 0, "the retry must still be waiting when the consumer stops")
	failing.Store(false)

	second := startWith(t, cfg, provider, sink, routes, app.Components{Relay: true, Consumers: true})
	eventually(t, "the retried message handled", func() bool { m, _ := runs(&done); return m == 1 })
	settle(t, second)
	m, total := runs(&done)
	require.Equal(t, 1, m)
	require.Equal(t, 1, total, "handled exactly once")
	_, sawSecond := attempts.Load(2)
	require.True(t, sawSecond, "the attempt count travels with the message")
	require.Empty(t, second.poisoned(t))
}

func TestRequeueBringsAPoisonedMessageBackOnce(t *testing.T) {
	t.Parallel()
	var failing atomic.Bool
	failing.Store(true)
	var worker, audit sync.Map
	h := start(t, app.Options{Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{
			counting("requeue.worker", "work.requeue", func(*message.Message) error {
				if failing.Load() {
					return errors.New("bug in the handler")
				}
				return nil
			}, &worker),
			// A second handler of the same topic that succeeded the first time.
			counting("requeue.audit", "work.requeue", func(*message.Message) error { return nil }, &audit),
		}, nil
	}}, app.Components{Relay: true, Consumers: true})
	publishEvent(t, h, "work.requeue", "job-7", job{N: 7})
	eventually(t, "the message poisoned", func() bool { return len(h.poisoned(t)) == 1 })
	rec := h.poisoned(t)[0]
	require.Equal(t, "requeue.worker", rec.Handler)

	dry, err := h.app.Poison().Requeue(context.Background(), pgpoison.Selector{Topic: "work.requeue"}, pgpoison.Run{DryRun: true})
	require.NoError(t, err)
	require.Len(t, dry.Requeued, 1)
	require.Len(t, h.poisoned(t), 1, "a dry run changes nothing")

	failing.Store(false) // the bug is fixed and deployed
	dupsBefore := h.app.Stats().Duplicates
	res, err := h.app.Poison().Requeue(context.Background(), pgpoison.Selector{IDs: []int64{rec.ID}}, pgpoison.Run{Actor: "test"})
	require.NoError(t, err)
	require.Len(t, res.MessageIDs, 1)
	require.Empty(t, h.poisoned(t))

	eventually(t, "the requeued message handled", func() bool { m, _ := runs(&worker); return m == 1 })
	// Proof that the copy reached the route that had succeeded, not a
	// sleep: its ledger skipped it as a duplicate.
	eventually(t, "the audit route skipped the requeued copy", func() bool { return h.app.Stats().Duplicates >= dupsBefore+1 })
	_, total := runs(&worker)
	require.Equal(t, 1, total)
	_, auditTotal := runs(&audit)
	require.Equal(t, 1, auditTotal, "the handler that had succeeded skips the requeued copy (ledger)")
	require.Empty(t, h.poisoned(t))

	// Discard: poison another and throw it away.
	failing.Store(true)
	publishEvent(t, h, "work.requeue", "job-8", job{N: 8})
	eventually(t, "the second message poisoned", func() bool { return len(h.poisoned(t)) == 1 })
	gone, err := h.app.Poison().Discard(context.Background(), pgpoison.Selector{All: true}, pgpoison.Run{Actor: "test"})
	require.NoError(t, err)
	require.Len(t, gone, 1)
	require.Empty(t, h.poisoned(t))
}

func TestBudgetDefersWithoutLosingOrDuplicating(t *testing.T) {
	t.Parallel()
	const jobs = 7
	cfg, provider, sink := testConfig(t)
	var calls atomic.Int32
	var done sync.Map
	var budget *middleware.Budget
	h := startWith(t, cfg, provider, sink, app.Options{Routes: budgeted(t, &budget,
		middleware.BudgetConfig{Name: "llm", Limit: 3, Window: 2 * time.Second},
		counting("llm.summarise", "work.llm", func(*message.Message) error { calls.Add(1); return nil }, &done))},
		app.Components{Relay: true, Consumers: true})
	for i := range jobs {
		publishEvent(t, h, "work.llm", fmt.Sprint("doc-", i), job{N: i})
	}
	eventually(t, "every job handled", func() bool { m, _ := runs(&done); return m == jobs })
	settle(t, h)
	m, total := runs(&done)
	require.Equal(t, jobs, m)
	require.Equal(t, jobs, total, "no job ran twice")
	require.EqualValues(t, jobs, calls.Load(), "no paid call beyond one per job")
	deferredBudget, _ := budget.Deferrals()
	require.Positive(t, deferredBudget, "a limit of 3 per 2s must have deferred some of 7 jobs")
	require.Empty(t, h.poisoned(t), "deferral is not failure")
}

func TestOpenCircuitDefersInsteadOfPoisoning(t *testing.T) {
	t.Parallel()
	cfg, provider, sink := testConfig(t)
	cfg.Retry.MaxRetries = -1 // let every failure reach the breaker
	cfg.DurableRetry.MaxAttempts = 20
	cfg.DurableRetry.Backoff = pipeline.Backoff{Initial: 20 * time.Millisecond, Max: 50 * time.Millisecond}
	var failures atomic.Int32
	var done sync.Map
	var budget *middleware.Budget
	h := startWith(t, cfg, provider, sink, app.Options{Routes: budgeted(t, &budget,
		middleware.BudgetConfig{Name: "api", Limit: 1000, Window: time.Minute, BreakerFailures: 3, BreakerOpenTimeout: 400 * time.Millisecond},
		counting("api.call", "work.api", func(*message.Message) error {
			if failures.Add(1) <= 6 {
				return errors.New("503 from the provider")
			}
			return nil
		}, &done))},
		app.Components{Relay: true, Consumers: true})
	for i := range 4 {
		publishEvent(t, h, "work.api", fmt.Sprint("req-", i), job{N: i})
	}
	eventually(t, "every request handled", func() bool { m, _ := runs(&done); return m == 4 })
	_, total := runs(&done)
	require.Equal(t, 4, total)
	_, deferredBreaker := budget.Deferrals()
	require.Positive(t, deferredBreaker, "the open circuit must have deferred calls")
	require.Empty(t, h.poisoned(t))
}

// The same message delivered to two consumers at once runs its effect once.
func TestConcurrentDuplicateDeliveriesRunOnce(t *testing.T) {
	t.Parallel()
	var effects atomic.Int32
	var entered atomic.Int32
	var overlapped atomic.Bool
	var h *harness
	h = start(t, app.Options{Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "slow.effect", Topic: "work.dup", Handler: func(msg *message.Message) error {
			entered.Add(1)
			// Hold the effect until the other delivery is seen waiting on
			// this one's ledger row (a backend blocked by this handler's
			// transaction): the two were in flight together, proven, not
			// assumed from a sleep.
			pid := pgledger.TxFromContext(msg.Context()).Conn().PgConn().PID()
			deadline := time.Now().Add(15 * time.Second)
			for time.Now().Before(deadline) && !overlapped.Load() {
				var waiting int
				if err := h.app.Pool().QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, pid).Scan(&waiting); err != nil {
					return err
				}
				overlapped.Store(waiting > 0)
				time.Sleep(10 * time.Millisecond)
			}
			effects.Add(1)
			return nil
		}}}, nil
	}}, app.Components{Consumers: true})
	require.GreaterOrEqual(t, h.cfg.AMQP.Consumers, 2)
	// Both workers attached before the two deliveries, so that the broker
	// gives one to each (a worker attaching late would get neither).
	eventually(t, "two workers consuming", func() bool {
		stats, err := h.app.QueueStats(context.Background())
		require.NoError(t, err)
		for _, st := range stats {
			if st.Handler != "" && pipeline.RouteName(st.Handler) == "slow.effect" && st.Consumers >= 2 {
				return true
			}
		}
		return false
	})
	ch, closeCh := h.channel(t)
	defer closeCh()
	for range 2 {
		require.NoError(t, ch.PublishWithContext(context.Background(), h.app.Topology().ExchangeName("work.dup"), "", false, false,
			amqp.Publishing{MessageId: "same-id", Body: []byte(`{}`), DeliveryMode: amqp.Persistent}))
	}
	eventually(t, "both deliveries seen", func() bool { return h.app.Stats().Duplicates == 1 })
	require.EqualValues(t, 1, effects.Load())
	require.True(t, overlapped.Load(), "the second delivery was in flight while the first ran (blocked on its ledger row)")
	require.EqualValues(t, 1, entered.Load(), "the second delivery waited on the ledger row and skipped the handler")
}

// On an ordered topic a failing message holds its partition through its
// retries: the later events of its aggregate are not handled before it.
func TestOrderedRouteRetriesInPlace(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var handled []int
	var failuresLeft atomic.Int32
	failuresLeft.Store(5) // more than the quick retries (1 + 2): it needs a held retry
	h := start(t, app.Options{Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "ordered.worker", Topic: "work.ordered", Ordered: true,
			Handler: handlers.Typed(func(ctx context.Context, j *job) error {
				if j.N == 0 && failuresLeft.Add(-1) >= 0 {
					return errors.New("not yet")
				}
				mu.Lock()
				handled = append(handled, j.N)
				mu.Unlock()
				return nil
			})}}, nil
	}}, app.Components{Relay: true, Consumers: true})
	for i := range 3 {
		publishEvent(t, h, "work.ordered", "acct-A", job{N: i})
	}
	eventually(t, "all three handled", func() bool { mu.Lock(); defer mu.Unlock(); return len(handled) == 3 })
	mu.Lock()
	require.Equal(t, []int{0, 1, 2}, handled)
	mu.Unlock()
	require.Empty(t, h.outboxRows(t, pgoutbox.RowFilter{Topic: pipeline.RetryTopic}), "an ordered message is not rescheduled behind its successors")
	require.Empty(t, h.poisoned(t))
}

// budgeted is a route table of one route behind a budget breaker on the
// test's schema; the breaker is stored in *b for the test to inspect.
func budgeted(t *testing.T, b **middleware.Budget, cfg middleware.BudgetConfig, r handlers.Route) func(app.Deps) ([]handlers.Route, error) {
	return func(d app.Deps) ([]handlers.Route, error) {
		spender, err := pgbudget.New(mustPool(t, d))
		if err != nil {
			return nil, err
		}
		cfg.Name += "-" + d.Config.DatabaseSchema // budgets are shared by name: one per test
		cfg.Spender = spender
		if *b, err = middleware.NewBudget(cfg, nil); err != nil {
			return nil, err
		}
		r.Middleware = []message.HandlerMiddleware{(*b).Middleware}
		return []handlers.Route{r}, nil
	}
}

// A delivery that reuses a processed message id with other content (a
// forged or broken publisher pre-empting a real event) is not dropped as a
// duplicate: it is poisoned with the reason, logged at WARN and counted.
func TestSameIDDifferentContentIsPoisonedNotDropped(t *testing.T) {
	t.Parallel()
	var effects sync.Map
	logs := &pipelinetest.SyncBuffer{}
	cfg, provider, sink := testConfig(t)
	h := startWith(t, cfg, provider, sink, app.Options{
		Logger: slog.New(pipeline.LogHandler(slog.NewTextHandler(logs, nil))),
		Routes: func(app.Deps) ([]handlers.Route, error) {
			return []handlers.Route{{Name: "mail.like", Topic: "work.forged", Handler: func(msg *message.Message) error {
				effects.Store(string(msg.Payload), true)
				return nil
			}}}, nil
		}}, app.Components{Consumers: true})
	ch, closeCh := h.channel(t)
	defer closeCh()
	publish := func(body string) {
		require.NoError(t, ch.PublishWithContext(context.Background(), h.app.Topology().ExchangeName("work.forged"), "", false, false,
			amqp.Publishing{MessageId: "next-id", Body: []byte(body), DeliveryMode: amqp.Persistent}))
	}
	publish(`{"to":"genuine"}`)
	eventually(t, "the first delivery handled", func() bool { _, ok := effects.Load(`{"to":"genuine"}`); return ok })
	publish(`{"to":"genuine"}`) // a real redelivery: same content
	publish(`{"to":"attacker"}`)
	var poisoned []pgpoison.Record
	eventually(t, "the conflicting delivery poisoned", func() bool { poisoned = h.poisoned(t); return len(poisoned) == 1 })
	eventually(t, "the redelivery seen as a duplicate", func() bool { return h.app.Stats().Duplicates == 1 })
	require.Equal(t, `{"to":"attacker"}`, string(poisoned[0].Payload))
	require.Contains(t, poisoned[0].Reason, "message id already processed with different content")
	require.True(t, poisoned[0].Permanent)
	_, ran := effects.Load(`{"to":"attacker"}`)
	require.False(t, ran)
	require.Contains(t, logs.String(), "level=WARN msg=\"message id reused with different content")
	rec := httptest.NewRecorder()
	h.app.AdminHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	require.Contains(t, rec.Body.String(), `ferry_consumer_messages_total{handler="mail.like",outcome="id_conflict"} 1`)
}

// A held ordered partition is visible outside its process: the consumer
// records which partition waits, since when, behind which message and why
// (status lists it under what needs a human, the metrics and the console
// show it), and removes the record once the head is handled. The head has
// a page of its own (payload, how many wait behind it), and "retry now"
// tries it at once instead of after its backoff (a minute here).
func TestHeldPartitionIsVisibleWhileItWaits(t *testing.T) {
	t.Parallel()
	cfg, provider, sink := testConfig(t)
	cfg.DurableRetry.MaxAttempts = 1000 // held for as long as the test says
	cfg.DurableRetry.Backoff = pipeline.Backoff{Initial: time.Minute, Max: time.Minute}
	var failing atomic.Bool
	failing.Store(true)
	var handled atomic.Int32
	h := startWith(t, cfg, provider, sink, app.Options{Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "held.worker", Topic: "work.held", Ordered: true,
			Handler: handlers.Typed(func(ctx context.Context, j *job) error {
				if failing.Load() {
					return errors.New("ledger service answered 503")
				}
				handled.Add(1)
				return nil
			})}}, nil
	}}, app.Components{Relay: true, Consumers: true})
	publishEvent(t, h, "work.held", "acct-H", job{N: 1})
	ctx := context.Background()
	var held []pgheld.Partition
	eventually(t, "the hold recorded", func() bool {
		var err error
		held, err = pgheld.List(ctx, h.app.Pool())
		return err == nil && len(held) == 1
	})
	require.Contains(t, held[0].Consumer, "held.worker@")
	require.Contains(t, held[0].LastError, "ledger service answered 503")
	require.GreaterOrEqual(t, held[0].Attempt, 2)

	rep, err := pgstatus.Collect(ctx, h.app.Pool(), pgoutbox.Table{}, pgstatus.DefaultAttemptsThreshold)
	require.NoError(t, err)
	require.Len(t, rep.Held, 1)
	require.NoError(t, h.app.Metrics().Refresh(ctx, h.app.Pool()))
	con, err := h.app.Console()
	require.NoError(t, err)
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodGet, "/console/", nil)
	req.RemoteAddr = "127.0.0.1:1"
	req.Header.Set("Authorization", "Bearer "+consoleToken)
	con.ServeHTTP(rec, req)
	require.Contains(t, rec.Body.String(), `id="held"`)
	require.Contains(t, rec.Body.String(), "ledger service answered 503")
	require.Contains(t, rec.Body.String(), `/console/held/`+held[0].Consumer, "the overview links the head's page")

	// Two more events of the aggregate wait behind the head.
	publishEvent(t, h, "work.held", "acct-H", job{N: 2})
	publishEvent(t, h, "work.held", "acct-H", job{N: 3})
	page := func() string {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodGet, "/console/held/"+held[0].Consumer, nil)
		req.Header.Set("Authorization", "Bearer "+consoleToken)
		con.ServeHTTP(rec, req)
		require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
		return rec.Body.String()
	}
	eventually(t, "two waiting behind the head", func() bool { return strings.Contains(page(), `<b id="behind">2</b>`) })
	body := page()
	require.Contains(t, body, held[0].MessageID)
	require.Contains(t, body, "&#34;n&#34;: 1", "the head's payload")
	require.Contains(t, body, "ledger service answered 503")

	// The provider is back; the head would wait out its minute. Retry now.
	failing.Store(false)
	asked := time.Now()
	rec = postConfirmed(t, con, "/console/held-actions", url.Values{"consumer": {held[0].Consumer}, "message_id": {held[0].MessageID}})
	require.Equal(t, http.StatusSeeOther, rec.Code, rec.Body.String())
	eventually(t, "the hold released", func() bool {
		held, err := pgheld.List(ctx, h.app.Pool())
		return err == nil && len(held) == 0 && handled.Load() == 3
	})
	require.Less(t, time.Since(asked), 30*time.Second, "retried at once, not after the backoff's minute")
	require.Len(t, pipelinetest.Audited(t, h.app.Pool(), "partition.retry-now"), 1)

	// The page of a partition no longer held says so.
	rec = httptest.NewRecorder()
	req = httptest.NewRequest(http.MethodGet, "/console/held/"+held[0].Consumer, nil)
	req.Header.Set("Authorization", "Bearer "+consoleToken)
	con.ServeHTTP(rec, req)
	require.Equal(t, http.StatusNotFound, rec.Code)
}

// A paused handler starts no message until it is resumed, in every
// process (two here, sharing the schema and the broker namespace), and
// then handles what waited in order; the console's handlers page pauses
// and resumes (audited), as `ferry pause` and `ferry resume` do. Nothing
// here waits a fixed time: the pause is seen when every consumer of the
// route has detached, and the messages wait when the broker holds them
// all ready (none in a process's hands).
func TestAPausedHandlerWaitsUntilResumed(t *testing.T) {
	t.Parallel()
	cfg, provider, sink := testConfig(t)
	var mu sync.Mutex
	var got []int
	opts := app.Options{Routes: func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "paused.worker", Topic: "work.paused", Ordered: true,
			Handler: handlers.Typed(func(ctx context.Context, j *job) error {
				mu.Lock()
				got = append(got, j.N)
				mu.Unlock()
				return nil
			})}}, nil
	}}
	h := startWith(t, cfg, provider, sink, opts, app.Components{Relay: true, Consumers: true})
	startWith(t, cfg, provider, sink, opts, app.Components{Consumers: true})
	handled := func() []int {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(got)
	}
	ctx := context.Background()
	// queues sums the route's queues at the broker: consumers, ready.
	queues := func() (consumers, ready int) {
		stats, err := h.app.QueueStats(ctx)
		require.NoError(t, err)
		n := 0
		for _, st := range stats {
			if pipeline.RouteName(st.Handler) == "paused.worker" {
				consumers += st.Consumers
				ready += st.Ready
				n++
			}
		}
		require.Positive(t, n, "the route's queues")
		return consumers, ready
	}
	eventually(t, "both processes consuming", func() bool { c, _ := queues(); return c >= 2 })
	con, err := h.app.Console()
	require.NoError(t, err)
	post := func(form url.Values) *httptest.ResponseRecorder {
		return postConfirmed(t, con, "/console/handler-actions", form)
	}
	rec := post(url.Values{"handler": {"paused.worker"}, "action": {"pause"}, "reason": {"provider incident #42"}})
	require.Equal(t, http.StatusSeeOther, rec.Code, rec.Body.String())
	require.Equal(t, http.StatusBadRequest, post(url.Values{"handler": {"no.such.route"}, "action": {"pause"}}).Code, "only the app's routes")
	require.Equal(t, http.StatusConflict, post(url.Values{"handler": {"paused.worker"}, "action": {"pause"}}).Code, "paused already")
	eventually(t, "every consumer of the paused route detached", func() bool { c, _ := queues(); return c == 0 })

	for i := 1; i <= 3; i++ {
		publishEvent(t, h, "work.paused", "acct-P", job{N: i})
	}
	eventually(t, "the events dispatched", func() bool {
		var pending int
		return h.app.Pool().QueryRow(ctx, `SELECT count(*) FROM `+pgoutbox.Table{}.View(pgoutbox.StatePending)+` o WHERE topic = 'work.paused'`).Scan(&pending) == nil && pending == 0
	})
	eventually(t, "the three wait at the broker, none in a process's hands", func() bool { _, r := queues(); return r == 3 })
	require.Empty(t, handled(), "nothing is handled while paused")
	rep, err := pgstatus.Collect(ctx, h.app.Pool(), pgoutbox.Table{}, pgstatus.DefaultAttemptsThreshold)
	require.NoError(t, err)
	require.Len(t, rep.Paused, 1)
	require.Equal(t, "provider incident #42", rep.Paused[0].Reason)
	page := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodGet, "/console/handlers", nil)
	req.Header.Set("Authorization", "Bearer "+consoleToken)
	con.ServeHTTP(page, req)
	require.Contains(t, page.Body.String(), "provider incident #42")
	require.Contains(t, page.Body.String(), `value="resume"`)

	rec = post(url.Values{"handler": {"paused.worker"}, "action": {"resume"}})
	require.Equal(t, http.StatusSeeOther, rec.Code, rec.Body.String())
	eventually(t, "the waiting events handled", func() bool { return len(handled()) == 3 })
	require.Equal(t, []int{1, 2, 3}, handled(), "in order")
	eventually(t, "the consumers attached again", func() bool { c, r := queues(); return c >= 2 && r == 0 })
	require.Len(t, pipelinetest.Audited(t, h.app.Pool(), "handler.pause"), 1)
	require.Len(t, pipelinetest.Audited(t, h.app.Pool(), "handler.resume"), 1)
}

// postConfirmed posts form to the console as a token holder and, when the
// console asks first (every action does), confirms with what the page
// carries, as an operator's click does.
func postConfirmed(t *testing.T, con http.Handler, path string, form url.Values) *httptest.ResponseRecorder {
	t.Helper()
	post := func(form url.Values) *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(form.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("Authorization", "Bearer "+consoleToken)
		con.ServeHTTP(rec, req)
		return rec
	}
	rec := post(form)
	body := rec.Body.String()
	if rec.Code != http.StatusOK || !strings.Contains(body, `id="confirm"`) {
		return rec
	}
	confirm := url.Values{}
	for _, part := range strings.Split(body, `<input type="hidden" name="`)[1:] {
		name, rest, _ := strings.Cut(part, `"`)
		_, value, _ := strings.Cut(rest, `value="`)
		value, _, _ = strings.Cut(value, `"`)
		confirm.Add(name, html.UnescapeString(value))
	}
	return post(confirm)
}
