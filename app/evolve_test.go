package app_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/evolve"
	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgledger"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/pipeline/pgstatus"
)

// Three versions of one event: euros as a float, then cents, then an
// amount with its currency.
type billV1 struct {
	ID    string  `json:"id"`
	Euros float64 `json:"euros"`
}

type billV2 struct {
	ID    string `json:"id"`
	Cents int64  `json:"cents"`
}

type money struct {
	Cents    int64  `json:"cents"`
	Currency string `json:"currency"`
}

type billV3 struct {
	ID     string `json:"id"`
	Amount money  `json:"amount"`
}

const billTopic = "bills.issued"

func up1to2(b billV1) (billV2, error) { return billV2{ID: b.ID, Cents: int64(b.Euros*100 + 0.5)}, nil }
func up2to3(b billV2) (billV3, error) {
	return billV3{ID: b.ID, Amount: money{Cents: b.Cents, Currency: "EUR"}}, nil
}
func down3to2(b billV3) (billV2, error) { return billV2{ID: b.ID, Cents: b.Amount.Cents}, nil }

// Events outlive the code that wrote them. Version 1 of a service stores
// events (some waiting on a delay, some poisoned by a bug of version 1);
// versions 2 and 3 then run side by side, as a rolling deploy has them,
// each producing its own version while consumers of both take from one
// queue (version 2 reads version 3 through a Down step shipped ahead of
// it); version 3 alone then requeues what version 1 poisoned. Every event
// has its effect once, with the amount it was written with, nothing is
// poisoned for its version, and the stored events decode with version 3.
func TestEventsOutliveTheirCodeAcrossARollingDeploy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	chain1, err := evolve.New[billV1](billTopic, "1")
	require.NoError(t, err)
	chain2, err := evolve.New[billV2](billTopic, "2", evolve.Up("1", "2", up1to2), evolve.Down("3", "2", down3to2))
	require.NoError(t, err)
	chain3, err := evolve.New[billV3](billTopic, "3", evolve.Up("1", "2", up1to2), evolve.Up("2", "3", up2to3))
	require.NoError(t, err)

	cfg := ferrytest.AppConfig(ferrytest.Schema(t), ferrytest.Rabbit(t))
	var mu sync.Mutex
	handledBy := map[string]int{} // version of the code that handled an id's event
	effect := func(ctx context.Context, code int, id string, cents int64) error {
		mu.Lock()
		handledBy[id] = code
		mu.Unlock()
		_, err := pgledger.TxFromContext(ctx).Exec(ctx, `INSERT INTO bill_effects (id, cents) VALUES ($1, $2)`, id, cents)
		return err
	}
	route := func(h message.NoPublishHandlerFunc) func(app.Deps) ([]handlers.Route, error) {
		return func(app.Deps) ([]handlers.Route, error) {
			return []handlers.Route{{Name: "bills.charge", Topic: billTopic, Handler: h}}, nil
		}
	}
	tornDown := false
	start := func(opts app.Options) (*app.App, func()) {
		opts.Migrate = true
		opts.Logger = slog.New(slog.DiscardHandler)
		a, err := app.New(ctx, cfg, opts)
		require.NoError(t, err)
		// The three versions share one broker namespace and one route
		// table: removed once, when the test ends.
		if !tornDown {
			ferrytest.TeardownTopology(t, a.Topology())
			tornDown = true
		}
		stop, err := a.Start(ctx, app.Components{Relay: true, Consumers: true})
		require.NoError(t, err)
		return a, func() {
			require.NoError(t, stop())
			require.NoError(t, a.Close())
		}
	}
	publish := func(a *app.App, msg *message.Message) {
		require.NoError(t, a.Outbox().InTx(ctx, a.Pool(), func(ctx context.Context, _ pgoutbox.Querier, p *pgoutbox.Pending) error {
			return p.PublishEvents(ctx, pipeline.Outgoing{Topic: billTopic, Msg: msg})
		}))
	}

	// Version 1: a tenth of its events hit a bug of its own and are
	// poisoned; twenty wait on a delay past its shutdown.
	a1, stop1 := start(app.Options{Events: []evolve.Schema{chain1}, Routes: route(handlers.Evolving(chain1, func(ctx context.Context, b *billV1) error {
		if b.Euros == 13 {
			return pipeline.Permanent(errors.New("version 1 cannot bill 13 euros"))
		}
		return effect(ctx, 1, b.ID, int64(b.Euros*100+0.5))
	}))})
	_, err = a1.Pool().Exec(ctx, `CREATE TABLE bill_effects (id text PRIMARY KEY, cents bigint NOT NULL)`)
	require.NoError(t, err)
	// Its consumers registered the route table, for the tools without it.
	registered, err := pgstatus.Routes(ctx, a1.Pool())
	require.NoError(t, err)
	require.Equal(t, []string{"bills.charge/" + billTopic}, func() (out []string) {
		for _, r := range registered {
			out = append(out, r.Route+"/"+r.Topic)
		}
		return out
	}())
	want := map[string]int64{}
	for i := range 100 {
		euros := float64(i%20) + 0.25
		if i%10 == 3 {
			euros = 13
		}
		id := fmt.Sprintf("v1-%d", i)
		msg, err := chain1.NewEvent(ctx, id, billV1{ID: id, Euros: euros})
		require.NoError(t, err)
		if i >= 80 {
			pipeline.WithDelay(msg, 10*time.Second)
		}
		publish(a1, msg)
		want[id] = int64(euros*100 + 0.5)
	}
	require.Eventually(t, func() bool {
		var done int
		poisoned, _ := a1.Poison().Count(ctx, pgpoison.Filter{})
		_ = a1.Pool().QueryRow(ctx, `SELECT count(*) FROM bill_effects`).Scan(&done)
		return poisoned == 8 && done == 72
	}, time.Minute, 50*time.Millisecond, "version 1 handled its events but the 13-euro ones (poisoned) and the delayed ones")
	// What status and metrics show: version 1 waiting, poisoned and delayed.
	stored, err := pgstatus.StoredVersions(ctx, a1.Pool(), testTable)
	require.NoError(t, err)
	counts := map[string]int{}
	for _, s := range stored {
		counts[s.Place+" "+s.Topic+" v"+s.Version] = s.Count
	}
	require.Equal(t, map[string]int{"poison bills.issued v1": 8, "pending bills.issued v1": 20}, counts)
	stop1()

	// Versions 2 and 3 at once, each producing its own version.
	a2, stop2 := start(app.Options{Events: []evolve.Schema{chain2}, Routes: route(handlers.Evolving(chain2, func(ctx context.Context, b *billV2) error {
		return effect(ctx, 2, b.ID, b.Cents)
	}))})
	a3, stop3 := start(app.Options{Events: []evolve.Schema{chain3}, Routes: route(handlers.Evolving(chain3, func(ctx context.Context, b *billV3) error {
		if b.Amount.Currency != "EUR" {
			return pipeline.Permanent(fmt.Errorf("currency %q", b.Amount.Currency))
		}
		return effect(ctx, 3, b.ID, b.Amount.Cents)
	}))})
	var wg sync.WaitGroup
	for i := range 300 {
		id2, id3 := fmt.Sprintf("v2-%d", i), fmt.Sprintf("v3-%d", i)
		want[id2], want[id3] = int64(100+i), int64(200+i)
		wg.Go(func() {
			msg, err := chain2.NewEvent(ctx, id2, billV2{ID: id2, Cents: int64(100 + i)})
			require.NoError(t, err)
			publish(a2, msg)
		})
		wg.Go(func() {
			msg, err := chain3.NewEvent(ctx, id3, billV3{ID: id3, Amount: money{Cents: int64(200 + i), Currency: "EUR"}})
			require.NoError(t, err)
			publish(a3, msg)
		})
		if i%50 == 49 {
			wg.Wait()
		}
	}
	wg.Wait()
	require.Eventually(t, func() bool {
		var done int
		_ = a3.Pool().QueryRow(ctx, `SELECT count(*) FROM bill_effects`).Scan(&done)
		return done == len(want)-8
	}, 2*time.Minute, 100*time.Millisecond, "every event but the poisoned ones handled by versions 2 and 3")
	stop2()

	// Version 3 alone requeues what version 1 poisoned.
	res, err := a3.Poison().Requeue(ctx, pgpoison.Selector{All: true}, pgpoison.Run{Actor: "test"})
	require.NoError(t, err)
	require.Len(t, res.Requeued, 8)
	require.Eventually(t, func() bool {
		var done int
		poisoned, _ := a3.Poison().Count(ctx, pgpoison.Filter{})
		_ = a3.Pool().QueryRow(ctx, `SELECT count(*) FROM bill_effects`).Scan(&done)
		return done == len(want) && poisoned == 0
	}, time.Minute, 50*time.Millisecond, "the requeued version 1 events are handled by version 3")

	got := map[string]int64{}
	rows, err := a3.Pool().Query(ctx, `SELECT id, cents FROM bill_effects`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		var cents int64
		require.NoError(t, rows.Scan(&id, &cents))
		got[id] = cents
	}
	require.NoError(t, rows.Err())
	require.Equal(t, want, got, "each event's effect once, with the amount it was written with")
	mu.Lock()
	byCode := map[int]int{}
	for _, code := range handledBy {
		byCode[code]++
	}
	mu.Unlock()
	require.Positive(t, byCode[2], "version 2 consumed during the rolling deploy")
	require.Positive(t, byCode[3])
	t.Logf("handled by version 1: %d, 2: %d, 3: %d", byCode[1], byCode[2], byCode[3])
	ferrytest.RequireStoredEventsDecode(t, a3.Pool(), testTable, chain3)
	stop3()
}
