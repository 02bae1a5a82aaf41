package agenttools_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/agenttools"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/pgretention"
	"github.com/ferry-dev/ferry/pipeline/pgtoolcalls"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

type noteArgs struct {
	Text  string `json:"text" jsonschema:"what to note"`
	Fail  bool   `json:"fail,omitempty"`
	Later bool   `json:"later,omitempty"`
}

func (a noteArgs) Validate() error {
	if a.Text == "" {
		return &agenttools.InputError{Fields: map[string]string{"text": "is required"}}
	}
	return nil
}

type noted struct {
	ID int64 `json:"id"`
}

var errBoom = errors.New("boom")

// note writes a row and an intent; it fails after both when asked to.
func note(t testing.TB, window time.Duration) agenttools.Tool {
	t.Helper()
	tl, err := agenttools.New(agenttools.Def{Name: "note", Description: "notes a text", KeyWindow: window},
		func(ctx context.Context, tx pgx.Tx, emit *agenttools.Emitter, in noteArgs) (noted, error) {
			var id int64
			if err := tx.QueryRow(ctx, `INSERT INTO notes (text, key) VALUES ($1, $2) RETURNING id`, in.Text, agenttools.KeyFromContext(ctx)).Scan(&id); err != nil {
				return noted{}, err
			}
			var opts []agenttools.IntentOption
			if in.Later {
				opts = append(opts, agenttools.After(3*time.Minute))
			}
			if _, err := emit.Emit(ctx, "note.made", "note", map[string]any{"id": id}, opts...); err != nil {
				return noted{}, err
			}
			if in.Fail {
				return noted{}, errBoom
			}
			return noted{ID: id}, nil
		})
	require.NoError(t, err)
	return tl
}

func setup(t testing.TB, ts ...agenttools.Tool) (*agenttools.Runner, *pgxpool.Pool) {
	t.Helper()
	pool := pipelinetest.Postgres(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE notes (id bigserial PRIMARY KEY, text text NOT NULL, key text NOT NULL)`)
	require.NoError(t, err)
	r, err := agenttools.NewRunner(pool, pipelinetest.Outbox(t), ts, nil)
	require.NoError(t, err)
	return r, pool
}

func counts(t testing.TB, pool *pgxpool.Pool) (notes, intents, calls int) {
	t.Helper()
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM notes`).Scan(&notes))
	recorded, err := pgtoolcalls.CountBefore(context.Background(), pool, time.Now().Add(time.Hour))
	require.NoError(t, err)
	rows, err := pipelinetest.OutboxTable(t).Rows(context.Background(), pool, pgoutbox.RowFilter{})
	require.NoError(t, err)
	return notes, len(rows), int(recorded)
}

func TestRunnerKeyedCalls(t *testing.T) {
	t.Parallel()
	r, pool := setup(t, note(t, 0))
	ctx := context.Background()

	_, err := r.Call(ctx, "note", "", json.RawMessage(`{"text":"a"}`))
	require.ErrorIs(t, err, agenttools.ErrMissingKey)
	_, err = r.Call(ctx, "note", "k\n1", json.RawMessage(`{"text":"a"}`))
	require.ErrorIs(t, err, agenttools.ErrInvalidKey)
	_, err = r.Call(ctx, "nope", "k", nil)
	require.ErrorIs(t, err, agenttools.ErrUnknownTool)
	_, err = r.Call(ctx, "note", "k", json.RawMessage(`{"text":""}`))
	var ie *agenttools.InputError
	require.ErrorAs(t, err, &ie)
	require.Equal(t, map[string]string{"text": "is required"}, ie.Fields)
	_, err = r.Call(ctx, "note", "k", json.RawMessage(`{"text":"a","idempotency_key":"x"}`))
	require.ErrorAs(t, err, &ie)
	require.True(t, ie.Malformed, "the key is no argument")
	n, i, c := counts(t, pool)
	require.Zero(t, n+i+c, "refused calls write nothing")

	// A body's error rolls back its row, its intent and the call record:
	// the same key then runs for real.
	_, err = r.Call(ctx, "note", "k", json.RawMessage(`{"text":"a","fail":true}`))
	require.ErrorIs(t, err, errBoom)
	n, i, c = counts(t, pool)
	require.Zero(t, n+i+c)

	first, err := r.Call(ctx, "note", "k", json.RawMessage(`{"text":"a"}`))
	require.NoError(t, err)
	require.False(t, first.Replay)
	require.Len(t, first.IntentIDs, 1)
	// Same arguments in another spelling: a replay.
	again, err := r.Call(ctx, "note", "k", json.RawMessage(` { "text" : "\u0061" } `))
	require.NoError(t, err)
	require.True(t, again.Replay)
	require.JSONEq(t, string(first.Output), string(again.Output))
	require.Equal(t, first.IntentIDs, again.IntentIDs)
	_, err = r.Call(ctx, "note", "k", json.RawMessage(`{"text":"b"}`))
	require.ErrorIs(t, err, agenttools.ErrKeyConflict)
	n, i, c = counts(t, pool)
	require.Equal(t, [3]int{1, 1, 1}, [3]int{n, i, c})

	// Concurrent calls with one key: one effect, one answer.
	var wg sync.WaitGroup
	outs := make([]string, 16)
	for k := range outs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := r.Call(ctx, "note", "together", json.RawMessage(`{"text":"c"}`))
			if err == nil {
				outs[k] = string(res.Output)
			}
		}()
	}
	wg.Wait()
	for _, o := range outs {
		require.Equal(t, outs[0], o)
		require.NotEmpty(t, o)
	}
	n, i, _ = counts(t, pool)
	require.Equal(t, 2, n)
	require.Equal(t, 2, i)
}

func TestRunnerDelayedIntentAndKeyWindow(t *testing.T) {
	t.Parallel()
	r, pool := setup(t, note(t, time.Hour))
	ctx := context.Background()
	res, err := r.Call(ctx, "note", "", json.RawMessage(`{"text":"later","later":true}`))
	require.NoError(t, err)
	require.True(t, res.KeyDerived, "the tool opted into a key from its arguments")
	require.True(t, strings.HasPrefix(res.Key, "derived-"))
	again, err := r.Call(ctx, "note", "", json.RawMessage(`{"text":"later","later":true}`))
	require.NoError(t, err)
	require.True(t, again.Replay, "the same arguments within the window are the same call")
	rows, err := pipelinetest.OutboxTable(t).Rows(ctx, pool, pgoutbox.RowFilter{})
	require.NoError(t, err)
	require.Len(t, rows, 1)
	delay := rows[0].AvailableAt.Sub(rows[0].CreatedAt)
	require.InDelta(t, (3 * time.Minute).Seconds(), delay.Seconds(), 1, "the intent waits in the same table")

	st, err := r.Call(ctx, agenttools.IntentStatusName, "", json.RawMessage(`{"aggregate_id":"note"}`))
	require.NoError(t, err)
	var out agenttools.StatusOutput
	require.NoError(t, json.Unmarshal(st.Output, &out))
	require.Len(t, out.Intents, 1)
	require.Equal(t, agenttools.StateScheduled, out.Intents[0].State)
	_, err = r.Call(ctx, agenttools.IntentStatusName, "", json.RawMessage(`{}`))
	require.Error(t, err, "intent_status needs an aggregate or a call")

	// Call records are pruned like the ledger.
	_, err = pool.Exec(ctx, `UPDATE ferry_tool_calls SET created_at = now() - interval '15 days'`)
	require.NoError(t, err)
	pr, err := pgretention.Prune(ctx, pool, pgretention.ToolCalls, pgretention.Options{OlderThan: pgretention.DefaultToolCallRetention})
	require.NoError(t, err)
	require.EqualValues(t, 1, pr.Removed)
}

func TestReadOnlyToolCannotEmit(t *testing.T) {
	t.Parallel()
	peek, err := agenttools.New(agenttools.Def{Name: "peek", Description: "tries to write", ReadOnly: true},
		func(ctx context.Context, tx pgx.Tx, emit *agenttools.Emitter, _ struct{}) (struct{}, error) {
			_, err := emit.Emit(ctx, "x", "a", map[string]int{})
			return struct{}{}, err
		})
	require.NoError(t, err)
	r, _ := setup(t, peek)
	_, err = r.Call(context.Background(), "peek", "", nil)
	require.ErrorIs(t, err, agenttools.ErrReadOnly)
}

func TestNewRefusesBadDefinitions(t *testing.T) {
	t.Parallel()
	body := func(context.Context, pgx.Tx, *agenttools.Emitter, struct{}) (struct{}, error) { return struct{}{}, nil }
	for _, d := range []agenttools.Def{{Name: "Bad Name", Description: "x"}, {Name: "ok"}, {Name: "ok", Description: "x", KeyWindow: -1}} {
		_, err := agenttools.New(d, body)
		require.Error(t, err, "%+v", d)
	}
	_, err := agenttools.New(agenttools.Def{Name: "scalar", Description: "x"}, func(context.Context, pgx.Tx, *agenttools.Emitter, int) (int, error) { return 0, nil })
	require.Error(t, err, "inputs are objects")
}

func TestHTTPHandler(t *testing.T) {
	t.Parallel()
	r, _ := setup(t, note(t, 0))
	srv := httptest.NewServer(agenttools.HTTPHandler(r, nil))
	defer srv.Close()
	post := func(key, body string) (int, map[string]any) {
		req, _ := http.NewRequest("POST", srv.URL+"/tools/note", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		var out map[string]any
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&out))
		return resp.StatusCode, out
	}
	code, out := post("h1", `{"text":"x"}`)
	require.Equal(t, 200, code, out)
	require.Equal(t, false, out["replay"])
	code, out = post("h1", `{"text":"x"}`)
	require.Equal(t, 200, code)
	require.Equal(t, true, out["replay"])
	code, _ = post("h1", `{"text":"y"}`)
	require.Equal(t, 409, code)
	code, _ = post("", `{"text":"x"}`)
	require.Equal(t, 400, code)
	// A key that is not UTF-8 is the caller's mistake: 400 with what is
	// wrong, never a 500 that says "safe to retry".
	code, out = post("k\xff\xfe", `{"text":"x"}`)
	require.Equal(t, 400, code, out)
	require.Equal(t, "invalid_idempotency_key", out["error"].(map[string]any)["code"])
	require.Contains(t, out["error"].(map[string]any)["message"], "not valid UTF-8")
	code, out = post("h2", `{"text":""}`)
	require.Equal(t, 422, code)
	require.Contains(t, out["error"].(map[string]any)["fields"], "text")
	code, _ = post("h2", `{"text":"x","text":"y"}`)
	require.Equal(t, 400, code)

	resp, err := http.Get(srv.URL + "/tools")
	require.NoError(t, err)
	defer resp.Body.Close()
	var cat struct {
		Tools []agenttools.Description `json:"tools"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&cat))
	require.Len(t, cat.Tools, 2)
	require.True(t, cat.Tools[0].KeyRequired)
	require.True(t, cat.Tools[1].ReadOnly)

	// An empty body is not {}, a missing Content-Type is refused, and
	// unknown paths and methods answer in the JSON envelope.
	code, out = post("h3", "")
	require.Equal(t, 400, code)
	require.Equal(t, "invalid_json", out["error"].(map[string]any)["code"])
	for _, tc := range []struct {
		method, path, contentType string
		status                    int
		code                      string
	}{
		{"POST", "/tools/note", "", 415, "unsupported_media_type"},
		{"POST", "/tools/note", "text/plain", 415, "unsupported_media_type"},
		{"GET", "/tools/note", "", 405, "method_not_allowed"},
		{"GET", "/nope", "", 404, "not_found"},
	} {
		req, _ := http.NewRequest(tc.method, srv.URL+tc.path, strings.NewReader(`{"text":"x"}`))
		req.Header.Set("Idempotency-Key", "h4")
		if tc.contentType != "" {
			req.Header.Set("Content-Type", tc.contentType)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, tc.status, resp.StatusCode, "%s %s %s", tc.method, tc.path, body)
		require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
		require.Contains(t, string(body), `"code":"`+tc.code+`"`)
	}
}

// A call's BEGIN rides on its record's INSERT, and its intents and stored
// result on its COMMIT: a body of one statement and one intent costs three
// round trips (six before InTx), and a replay two.
func TestRunnerCallRoundTrips(t *testing.T) {
	t.Parallel()
	_, base := setup(t)
	pool, rt := pipelinetest.CountingPool(t, base)
	r, err := agenttools.NewRunner(pool, pipelinetest.Outbox(t), []agenttools.Tool{note(t, 0)}, nil)
	require.NoError(t, err)
	ctx := context.Background()
	_, err = r.Call(ctx, "note", "warm", json.RawMessage(`{"text":"warm"}`))
	require.NoError(t, err)
	_, err = r.Call(ctx, "note", "warm", json.RawMessage(`{"text":"warm"}`))
	require.NoError(t, err)
	rt.Take()

	_, err = r.Call(ctx, "note", "k", json.RawMessage(`{"text":"a"}`))
	require.NoError(t, err)
	queries, batches := rt.Take()
	require.Equal(t, 3, len(queries)+batches, "record+BEGIN, the body's INSERT, intents+result+COMMIT; queries: %q", queries)

	res, err := r.Call(ctx, "note", "k", json.RawMessage(`{"text":"a"}`))
	require.NoError(t, err)
	require.True(t, res.Replay)
	queries, batches = rt.Take()
	require.Equal(t, 3, len(queries)+batches, "record+BEGIN, the stored call, COMMIT; queries: %q", queries)
	n, i, c := counts(t, base)
	require.Equal(t, [3]int{2, 2, 2}, [3]int{n, i, c})
}

// An intent whose INSERT fails in the COMMIT's round trip takes the whole
// call back: no business row, no call record, and an error, not a result.
func TestRunnerIntentFailingAtCommitRollsBackTheCall(t *testing.T) {
	t.Parallel()
	_, pool := setup(t)
	broken, err := pgoutbox.New(pgoutbox.Config{Table: noSuchOutbox(t)}, nil)
	require.NoError(t, err)
	r, err := agenttools.NewRunner(pool, broken, []agenttools.Tool{note(t, 0)}, nil)
	require.NoError(t, err)
	res, err := r.Call(context.Background(), "note", "k", json.RawMessage(`{"text":"a"}`))
	require.Error(t, err)
	require.Nil(t, res)
	require.Contains(t, err.Error(), "no_such_outbox")
	n, i, c := counts(t, pool)
	require.Zero(t, n+i+c, "nothing of the call is left")
}

// intent_status answers a model, without a token: whatever a handler let
// into an error (a provider's answer quoting an email or a card number, a
// megabyte of it, bytes that are not UTF-8), it shows a short, masked,
// clean summary.
func TestIntentStatusShowsNoPersonalData(t *testing.T) {
	t.Parallel()
	_, pool := setup(t)
	ctx := context.Background()
	reason := "payment provider answered 400: customer erin@example.com, card 4242 4242 4242 4242, Kunde ung\xfcltig " + strings.Repeat("x", 1<<20)
	pipelinetest.InsertOutbox(t, pool, pipelinetest.OutboxTable(t),
		pipelinetest.OutboxRow{MessageUUID: "m-1", AggregateID: "o-1", Topic: "stripe.charge", Attempts: 2, LastError: pipelineClean(reason)})
	pipelinetest.InsertPoison(t, pool, pipelinetest.PoisonRow{MessageID: "m-1", Topic: "stripe.charge", Handler: "payments.charge", Reason: pipelineClean(reason)})
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	out, err := agenttools.IntentStatus(ctx, tx, pgoutbox.Table{}, agenttools.StatusInput{AggregateID: "o-1"})
	require.NoError(t, err)
	require.Len(t, out.Intents, 1)
	in := out.Intents[0]
	require.Len(t, in.Poisoned, 1)
	for _, text := range []string{in.LastError, in.Poisoned[0].Reason} {
		require.NotContains(t, text, "erin@example.com")
		require.NotContains(t, text, "4242")
		require.LessOrEqual(t, len(text), agenttools.MaxStatusErrorLength)
		require.Contains(t, text, "payment provider answered 400")
	}
}

func pipelineClean(s string) string { return strings.ToValidUTF8(s, "?") }

func noSuchOutbox(t testing.TB) pgoutbox.Table {
	t.Helper()
	tbl, err := pgoutbox.ParseTable("no_such_outbox")
	require.NoError(t, err)
	return tbl
}
