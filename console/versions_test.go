package console_test

import (
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/console"
	"github.com/ferry-dev/ferry/evolve"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

type chargeV1 struct {
	OrderID string  `json:"order_id"`
	Euros   float64 `json:"euros"`
}

type chargeV2 struct {
	OrderID string `json:"order_id"`
	Cents   int64  `json:"cents"`
}

// A poisoned event of an older version is shown as its handler will see
// it after a requeue, or with the reason the handler will refuse it.
func TestAStoredEventIsShownAsTheCurrentVersion(t *testing.T) {
	t.Parallel()
	pool := pipelinetest.Postgres(t)
	store, err := pgpoison.NewStore(pool, pipelinetest.Outbox(t))
	require.NoError(t, err)
	chain, err := evolve.New[chargeV2]("stripe.charge", "2", evolve.Up("1", "2", func(c chargeV1) (chargeV2, error) {
		if c.Euros < 0 {
			return chargeV2{}, errors.New("a refund is not a charge")
		}
		return chargeV2{OrderID: c.OrderID, Cents: int64(c.Euros*100 + 0.5)}, nil
	}))
	require.NoError(t, err)
	c, err := console.New(pool, store, console.Config{Token: token, Events: []evolve.Schema{chain}, Logger: slog.New(failOnRenderError{t})})
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.Handle("/console/", c)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	stored := func(id, payload, version string) pipelinetest.PoisonRow {
		return pipelinetest.PoisonRow{MessageID: id, Topic: "stripe.charge", Handler: "payments.charge", Payload: payload, Reason: "boom",
			Headers: map[string]string{"schema_version": version}}
	}
	ids := pipelinetest.InsertPoison(t, pool,
		stored("a", `{"order_id":"o-1","euros":12.5}`, "1"),
		stored("b", `{"order_id":"o-2","euros":-1}`, "1"),
		stored("c", `{"order_id":"o-3","cents":5}`, "2"))
	ok, refused, current := ids[0], ids[1], ids[2]

	reader := loggedIn(t, srv)
	_, body := get(t, reader, srv.URL+"/console/poison/"+itoa(ok))
	require.Contains(t, body, "As version 2 (stored as 1): what the handler sees")
	require.Contains(t, body, `&#34;cents&#34;: 1250`)
	_, body = get(t, reader, srv.URL+"/console/poison/"+itoa(refused))
	require.Contains(t, body, "The handler will refuse it: event type &#34;stripe.charge&#34;: up step 1→2: a refund is not a charge")
	_, body = get(t, reader, srv.URL+"/console/poison/"+itoa(current))
	require.NotContains(t, body, "As version")
}
