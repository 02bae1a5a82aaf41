package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ferry-dev/ferry/app"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/middleware"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
)

// HandlerFaults are the faults a fault-injection run makes consumer
// handlers suffer: fail (an error) and panic, at random, before the effect.
type HandlerFaults struct {
	FailRate, PanicRate float64
	Seed                uint64
}

func ParseFaults(v string) (*HandlerFaults, error) {
	f := &HandlerFaults{Seed: 1}
	for _, kv := range strings.Split(v, ",") {
		k, val, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok {
			return nil, fmt.Errorf("want key=value pairs (fail, panic, seed), got %q", kv)
		}
		var err error
		switch k {
		case "fail":
			f.FailRate, err = strconv.ParseFloat(val, 64)
		case "panic":
			f.PanicRate, err = strconv.ParseFloat(val, 64)
		case "seed":
			f.Seed, err = strconv.ParseUint(val, 10, 64)
		default:
			return nil, fmt.Errorf("unknown fault %q (fail, panic, seed)", k)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", k, err)
		}
	}
	if f.FailRate < 0 || f.PanicRate < 0 || f.FailRate+f.PanicRate > 1 {
		return nil, errors.New("fault rates must be in [0, 1] and add up to at most 1")
	}
	return f, nil
}

// ChaosAuditTopic is the ordered topic a fault-injection run checks
// per-aggregate order on.
const ChaosAuditTopic = "chaos.audit"

// ChaosAudit is one event of it: seq increases per aggregate in commit order.
type ChaosAudit struct {
	Aggregate string `json:"aggregate"`
	Seq       int64  `json:"seq"`
}

// ChaosBatchRoute is a batch route (handlers.Batch) over the orders'
// mail.send events that counts each order in ChaosBatchTable in its batch's
// transaction: a count above one is an effect run twice, a missing one an
// effect lost, whatever the faults did to the batches.
const (
	ChaosBatchRoute = "chaos.mail-seen"
	ChaosBatchTable = "chaos_mail_seen"
)

// chaosBatchTableSQL creates ChaosBatchTable; the run's driver does,
// before any consumer starts.
const chaosBatchTableSQL = `CREATE TABLE IF NOT EXISTS ` + ChaosBatchTable + ` (order_id text PRIMARY KEY, n int NOT NULL)`

// WithFaults adds, for fault-injection runs, the audit route (ordered:
// it reports each event to the sandbox provider, which records arrival
// order), the batch route ChaosBatchRoute and the fault
// link, innermost, so a fault strikes before the effect, inside the ledger
// transaction, as a handler bug would.
func WithFaults(opts app.Options, f HandlerFaults, paymentURL string) app.Options {
	routes := opts.Routes
	opts.Routes = func(d app.Deps) ([]handlers.Route, error) {
		rs, err := routes(d)
		if err != nil {
			return nil, err
		}
		client := &http.Client{Timeout: 5 * time.Second}
		return append(rs, chaosBatch(), handlers.Route{
			Name: "chaos.audit", Topic: ChaosAuditTopic, Ordered: true,
			Handler: handlers.Typed(func(ctx context.Context, e *ChaosAudit) error {
				key, err := handlers.IdempotencyKey(ctx)
				if err != nil {
					return err
				}
				body, _ := json.Marshal(e)
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, paymentURL+"/v1/audit", bytes.NewReader(body))
				if err != nil {
					return err
				}
				req.Header.Set("Idempotency-Key", key)
				resp, err := client.Do(req)
				if err != nil {
					return err
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					return fmt.Errorf("audit sink answered %d", resp.StatusCode)
				}
				return nil
			}),
		}), nil
	}
	chain := opts.Chain
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(f.Seed, f.Seed^0x9e3779b97f4a7c15))
	link := middleware.Link{Name: "chaos-faults", Middleware: func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			mu.Lock()
			x := rng.Float64()
			mu.Unlock()
			switch {
			case x < f.PanicRate:
				panic(injectedPanic)
			case x < f.PanicRate+f.FailRate:
				return nil, errInjectedFailure
			}
			return h(msg)
		}
	}}
	opts.Chain = func(c middleware.Chain) (middleware.Chain, error) {
		if chain != nil {
			var err error
			if c, err = chain(c); err != nil {
				return nil, err
			}
		}
		return c.Append(link)
	}
	return opts
}

// chaosBatch is the batch route ChaosBatchRoute.
func chaosBatch() handlers.Route {
	return handlers.Route{
		Name: ChaosBatchRoute, Topic: orders.TopicMailRequested,
		Batch: &handlers.Batch{MaxSize: 50, Handler: func(ctx context.Context, msgs []*message.Message) error {
			ids := make([]string, len(msgs))
			for i, m := range msgs {
				ids[i] = m.Metadata.Get(pipeline.MetaAggregateID)
			}
			// In key order: two batches at once never lock rows in
			// opposite orders.
			_, err := pgledger.TxFromContext(ctx).Exec(ctx, `INSERT INTO `+ChaosBatchTable+` (order_id, n)
				SELECT id, count(*) FROM unnest($1::text[]) AS id GROUP BY id ORDER BY id
				ON CONFLICT (order_id) DO UPDATE SET n = `+ChaosBatchTable+`.n + excluded.n`, ids)
			return err
		}},
	}
}

// The faults' own words: the run's invariants accept no other poison
// reason. The failure's text also carries what no database column takes
// (Latin-1 bytes and a NUL, as a provider's answer may): every place Ferry
// stores an error (retry headers, error history, the poison store) must
// take it cleaned, never refuse it and loop.
const (
	injectedPanic       = "chaos: injected panic"
	injectedFailureText = "chaos: injected failure"
)

var errInjectedFailure = errors.New(injectedFailureText + ": Kunde ung\xfcltig\x00")
