package orders_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	exmigrations "github.com/ferry-dev/ferry/examples/orders/migrations"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/agenttools"
	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

func setup(t *testing.T) (*orders.Service, *pgxpool.Pool, *sql.DB) {
	t.Helper()
	pool := pipelinetest.Postgres(t, exmigrations.Set)
	db := pgdb.SQLDB(pool)
	t.Cleanup(func() { db.Close() })
	svc, err := orders.NewService(db, pipelinetest.Outbox(t), nil)
	require.NoError(t, err)
	return svc, pool, db
}

func counts(t *testing.T, pool *pgxpool.Pool) (ordersN, outboxN int) {
	t.Helper()
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM orders`).Scan(&ordersN))
	return ordersN, len(outboxRows(t, pool))
}

// outboxRows is every event in the outbox, in id order.
func outboxRows(t *testing.T, pool *pgxpool.Pool) []pgoutbox.Row {
	t.Helper()
	rows, err := pgoutbox.Table{}.Rows(context.Background(), pool, pgoutbox.RowFilter{})
	require.NoError(t, err)
	return rows
}

var valid = orders.Input{UserID: "alice", Amount: 1200, Currency: "JPY", IdempotencyKey: "k-1"}

func TestInputValidate(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", 300)
	cases := []struct {
		name  string
		edit  func(*orders.Input)
		field string
	}{
		{"missing user", func(in *orders.Input) { in.UserID = "" }, "user_id"},
		{"long user", func(in *orders.Input) { in.UserID = long }, "user_id"},
		{"invalid UTF-8 user", func(in *orders.Input) { in.UserID = "\xff\xfe" }, "user_id"},
		{"control character", func(in *orders.Input) { in.UserID = "a\x00b" }, "user_id"},
		{"zero amount", func(in *orders.Input) { in.Amount = 0 }, "amount"},
		{"negative amount", func(in *orders.Input) { in.Amount = -5 }, "amount"},
		{"huge amount", func(in *orders.Input) { in.Amount = 1 << 62 }, "amount"},
		{"unknown currency", func(in *orders.Input) { in.Currency = "EUR" }, "currency"},
		{"lower-case currency", func(in *orders.Input) { in.Currency = "usd" }, "currency"},
		{"missing key", func(in *orders.Input) { in.IdempotencyKey = "" }, "idempotency_key"},
		{"long key", func(in *orders.Input) { in.IdempotencyKey = long }, "idempotency_key"},
	}
	require.NoError(t, valid.Validate())
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in := valid
			tc.edit(&in)
			err := in.Validate()
			require.ErrorIs(t, err, orders.ErrInvalidInput)
			var verr *orders.ValidationError
			require.ErrorAs(t, err, &verr)
			require.Contains(t, verr.Fields, tc.field)
			require.Len(t, verr.Fields, 1)
		})
	}
	// Every problem at once.
	var verr *orders.ValidationError
	require.ErrorAs(t, orders.Input{}.Validate(), &verr)
	require.Len(t, verr.Fields, 4)
}

func TestCreateOrderWritesOrderAndTwoEvents(t *testing.T) {
	t.Parallel()
	svc, pool, _ := setup(t)
	res, err := svc.CreateOrder(context.Background(), valid)
	require.NoError(t, err)
	require.False(t, res.Deduped)
	require.NotZero(t, res.OrderID)

	var got []string
	for _, r := range outboxRows(t, pool) {
		var payload struct {
			OrderID json.Number `json:"order_id"`
		}
		require.NoError(t, json.Unmarshal(r.Payload, &payload))
		require.Equal(t, r.AggregateID, payload.OrderID.String())
		got = append(got, r.Topic)
	}
	require.Equal(t, []string{orders.TopicChargeRequested, orders.TopicMailRequested}, got)
}

func TestFailureBeforeCommitLeavesNoOrderAndNoEvent(t *testing.T) {
	t.Parallel()
	svc, pool, db := setup(t)
	tx, err := db.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	_, err = svc.CreateOrderTx(context.Background(), tx, valid)
	require.NoError(t, err, "the order and both events are written in the transaction")
	// The business transaction then fails after the events were published.
	require.NoError(t, tx.Rollback())
	o, e := counts(t, pool)
	require.Zero(t, o)
	require.Zero(t, e)
}

func TestRepeatedKeyIsDedupedAndWritesNoEvent(t *testing.T) {
	t.Parallel()
	svc, pool, _ := setup(t)
	first, err := svc.CreateOrder(context.Background(), valid)
	require.NoError(t, err)
	again, err := svc.CreateOrder(context.Background(), valid)
	require.NoError(t, err)
	require.True(t, again.Deduped)
	require.Equal(t, first.OrderID, again.OrderID)
	o, e := counts(t, pool)
	require.Equal(t, 1, o)
	require.Equal(t, 2, e)

	other := valid
	other.Amount = 999
	_, err = svc.CreateOrder(context.Background(), other)
	require.ErrorIs(t, err, orders.ErrIdempotencyKeyReused)
	o, e = counts(t, pool)
	require.Equal(t, 1, o)
	require.Equal(t, 2, e)
}

func TestConcurrentRepeatsCreateOneOrder(t *testing.T) {
	t.Parallel()
	svc, pool, _ := setup(t)
	errs := make(chan error, 8)
	deduped := make(chan bool, 8)
	for range 8 {
		go func() {
			res, err := svc.CreateOrder(context.Background(), valid)
			errs <- err
			deduped <- res.Deduped
		}()
	}
	fresh := 0
	for range 8 {
		require.NoError(t, <-errs)
		if !<-deduped {
			fresh++
		}
	}
	require.Equal(t, 1, fresh)
	o, e := counts(t, pool)
	require.Equal(t, 1, o)
	require.Equal(t, 2, e)
}

func TestHTTPCreateOrder(t *testing.T) {
	t.Parallel()
	_, pool, _ := setup(t)
	ts, err := orders.Tools()
	require.NoError(t, err)
	runner, err := agenttools.NewRunner(pool, pipelinetest.Outbox(t), ts, nil)
	require.NoError(t, err)
	srv := httptest.NewServer(orders.Handler(runner, nil))
	defer srv.Close()

	post := func(key, contentType, body string) (*http.Response, string) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(body))
		require.NoError(t, err)
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		if contentType != "" {
			req.Header.Set("Content-Type", contentType)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp, string(b)
	}

	const ok = `{"user_id":"alice","amount":1200,"currency":"JPY"}`
	bad := []struct {
		name, key, contentType, body string
		status                       int
		code                         string
	}{
		{"no key", "", "application/json", ok, 400, "missing_idempotency_key"},
		{"key not UTF-8", "k\xff\xfe", "application/json", ok, 400, "invalid_idempotency_key"},
		{"key too long", strings.Repeat("k", 256), "application/json", ok, 400, "invalid_idempotency_key"},
		{"not JSON", "k", "application/json", `{"user_id":`, 400, "invalid_json"},
		{"wrong type", "k", "application/json", `{"user_id":"a","amount":"12","currency":"JPY"}`, 400, "invalid_json"},
		{"float amount", "k", "application/json", `{"user_id":"a","amount":12.5,"currency":"JPY"}`, 400, "invalid_json"},
		{"unknown field", "k", "application/json", `{"user_id":"a","amount":12,"currency":"JPY","admin":true}`, 400, "invalid_json"},
		{"two objects", "k", "application/json", ok + ok, 400, "invalid_json"},
		{"wrong content type", "k", "text/plain", ok, 415, "unsupported_media_type"},
		{"negative amount", "k", "application/json", `{"user_id":"a","amount":-1,"currency":"JPY"}`, 422, "invalid_input"},
		{"huge amount", "k", "application/json", `{"user_id":"a","amount":1000000000000,"currency":"JPY"}`, 422, "invalid_input"},
		{"unknown currency", "k", "application/json", `{"user_id":"a","amount":1,"currency":"EUR"}`, 422, "invalid_input"},
		{"SQL-looking user id", "k", "application/json", `{"user_id":"x'); DROP TABLE orders;--","amount":1,"currency":"EUR"}`, 422, "invalid_input"},
		{"invalid UTF-8", "k", "application/json", "{\"user_id\":\"\xff\",\"amount\":1,\"currency\":\"JPY\"}", 400, "invalid_json"},
		{"duplicate key", "k", "application/json", `{"user_id":"a","amount":12,"amount":99,"currency":"JPY"}`, 400, "invalid_json"},
		{"case-folded field", "k", "application/json", `{"USER_ID":"a","amount":12,"currency":"JPY"}`, 400, "invalid_json"},
		{"NUL in a string", "k", "application/json", `{"user_id":"a\u0000","amount":12,"currency":"JPY"}`, 400, "invalid_json"},
		{"no content type", "k", "", ok, 415, "unsupported_media_type"},
		{"latin1 charset", "k", "application/json; charset=latin1", ok, 415, "unsupported_media_type"},
		{"ESMTP parameter injection", "k", "application/json", `{"user_id":"a> NOTIFY=SUCCESS ORCPT=rfc822;x@evil","amount":1,"currency":"JPY"}`, 422, "invalid_input"},
		{"address in user id", "k", "application/json", `{"user_id":"bob@evil.example","amount":1,"currency":"JPY"}`, 422, "invalid_input"},
		{"oversize body", "k", "application/json", `{"user_id":"` + strings.Repeat("a", orders.MaxRequestBytes) + `"}`, 413, "body_too_large"},
		{"oversize non-JSON body", "k", "application/json", strings.Repeat("a", 70<<10), 413, "body_too_large"},
		{"empty body", "k", "application/json", "", 400, "invalid_json"},
		{"blank body", "k", "application/json", " \n\t", 400, "invalid_json"},
	}
	for _, tc := range bad {
		resp, body := post(tc.key, tc.contentType, tc.body)
		require.Equal(t, tc.status, resp.StatusCode, "%s: %s", tc.name, body)
		require.Contains(t, body, `"code":"`+tc.code+`"`, tc.name)
		require.Equal(t, "application/json", resp.Header.Get("Content-Type"), tc.name)
		for _, goName := range []string{"Go struct", "createOrderRequest", "int64", "json: "} {
			require.NotContains(t, body, goName, "%s: errors name fields, not Go types", tc.name)
		}
	}
	_, body := post("k", "application/json", `{"user_id":"a","amount":"12","currency":"JPY"}`)
	require.Contains(t, body, `"fields":{"amount":"must be a whole number in range, got string"}`)
	_, body = post("k", "application/json", `{"user_id":"a","amount":12,"amount":99,"currency":"JPY"}`)
	require.Contains(t, body, `"amount":"is given twice"`)

	// Unknown paths and methods answer in the same JSON envelope.
	for _, tc := range []struct {
		method, path string
		status       int
		code         string
	}{{http.MethodGet, "/orders", 405, "method_not_allowed"}, {http.MethodPost, "/nope", 404, "not_found"}, {http.MethodDelete, "/orders", 405, "method_not_allowed"}} {
		req, err := http.NewRequest(tc.method, srv.URL+tc.path, nil)
		require.NoError(t, err)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, tc.status, resp.StatusCode, "%s %s", tc.method, tc.path)
		require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
		require.Contains(t, string(b), `"code":"`+tc.code+`"`)
		if tc.status == 405 {
			require.Equal(t, "POST", resp.Header.Get("Allow"))
		}
	}
	// A correlation id travels in every event's headers: one that is not
	// printable text is the client's mistake (400), not a server error.
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(ok))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "k-corr")
	req.Header.Set("X-Correlation-ID", "corr-\xff\xfe")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	cb, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusBadRequest, resp.StatusCode, string(cb))
	require.Contains(t, string(cb), "invalid_correlation_id")

	o, e := counts(t, pool)
	require.Zero(t, o, "refused requests must write nothing")
	require.Zero(t, e)

	resp, body = post("k-http", "application/json; charset=UTF-8", ok)
	require.Equal(t, http.StatusCreated, resp.StatusCode, body)
	require.Contains(t, body, `"deduped":false`)
	require.NotEmpty(t, resp.Header.Get("X-Correlation-ID"))
	resp, body = post("k-http", "application/json", ok)
	require.Equal(t, http.StatusOK, resp.StatusCode, body)
	require.Contains(t, body, `"deduped":true`)
	resp, body = post("k-http", "application/json", `{"user_id":"alice","amount":1,"currency":"JPY"}`)
	require.Equal(t, http.StatusUnprocessableEntity, resp.StatusCode, body)
	require.Contains(t, body, "idempotency_key_reused")
	o, e = counts(t, pool)
	require.Equal(t, 1, o)
	require.Equal(t, 2, e)
}

func TestNewServiceNeedsDependencies(t *testing.T) {
	t.Parallel()
	_, err := orders.NewService(nil, nil, nil)
	require.Error(t, err)
	require.False(t, errors.Is(err, orders.ErrInvalidInput))
}
