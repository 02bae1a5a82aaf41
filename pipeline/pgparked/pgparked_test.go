package pgparked_test

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/pgparked"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// A group parks in order; a new event goes behind any parked one; an
// event sent back runs unless one parked before it is still there; Send
// takes each event once, in order, and one sender at a time.
func TestAGroupIsParkedAndSentBackInOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	store := pgparked.Store{Pool: pipelinetest.Postgres(t)}
	const p = "payments.charge@3"

	behind, err := store.Admit(ctx, p, "acme", 0)
	require.NoError(t, err)
	require.False(t, behind, "nothing parked: a new event runs")
	for _, id := range []string{"m-1", "m-2", "m-3", "m-2"} {
		require.NoError(t, store.Park(ctx, p, "acme", id, []byte(`{}`), map[string]string{"tenant_id": "acme"}, "out of reach"))
	}
	require.NoError(t, store.Park(ctx, p, "bolt", "m-9", []byte(`{}`), nil, "out of reach"))
	for tenant, want := range map[string]bool{"acme": true, "crux": false} {
		behind, err := store.Admit(ctx, p, tenant, 0)
		require.NoError(t, err)
		require.Equal(t, want, behind, tenant)
	}
	behind, err = store.Admit(ctx, "payments.charge@4", "acme", 0)
	require.NoError(t, err)
	require.False(t, behind, "another partition's events do not wait")

	groups, err := store.Groups(ctx, true)
	require.NoError(t, err)
	require.Len(t, groups, 2)
	acme := groups[0]
	require.Equal(t, pgparked.Group{Consumer: p, TenantID: "acme", Parked: 3, Waiting: 3, Since: acme.Since}, acme, "a delivery that came again keeps its place")

	var sent []pgparked.Event
	n, err := store.Send(ctx, acme, func(_ context.Context, events []pgparked.Event) error {
		sent = events
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, 3, n)
	require.Equal(t, []string{"m-1", "m-2", "m-3"}, []string{sent[0].MessageID, sent[1].MessageID, sent[2].MessageID})
	require.Equal(t, map[string]string{"tenant_id": "acme"}, sent[0].Headers)
	n, err = store.Send(ctx, acme, func(context.Context, []pgparked.Event) error { t.Fatal("sent twice"); return nil })
	require.NoError(t, err)
	require.Zero(t, n)
	groups, err = store.Groups(ctx, true)
	require.NoError(t, err)
	require.Len(t, groups, 1, "acme's events are sent; bolt's wait")

	// m-1 met the outage again: m-2 and m-3, arriving behind it, wait.
	found, err := store.Unsend(ctx, sent[0].Seq, "out of reach again")
	require.NoError(t, err)
	require.True(t, found)
	for i, want := range []bool{false, true, true} {
		behind, err := store.Admit(ctx, p, "acme", sent[i].Seq)
		require.NoError(t, err)
		require.Equal(t, want, behind, sent[i].MessageID)
	}
	require.NoError(t, store.Done(ctx, sent[0].Seq))
	behind, err = store.Admit(ctx, p, "acme", sent[1].Seq)
	require.NoError(t, err)
	require.False(t, behind, "m-1 handled: m-2 runs")
	behind, err = store.Admit(ctx, p, "acme", sent[0].Seq)
	require.NoError(t, err)
	require.False(t, behind, "m-1 again (handled already) runs, a no-op for its ledger")
	found, err = store.Unsend(ctx, sent[0].Seq, "")
	require.NoError(t, err)
	require.False(t, found)

	// One sender at a time: the other is told so, and sends nothing.
	require.NoError(t, store.Park(ctx, p, "acme", "m-4", []byte(`{}`), nil, "out of reach"))
	inside, release := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		_, err := store.Send(ctx, acme, func(context.Context, []pgparked.Event) error { close(inside); <-release; return nil })
		require.NoError(t, err)
	})
	<-inside
	_, err = store.Send(ctx, acme, func(context.Context, []pgparked.Event) error { t.Error("two senders at once"); return nil })
	require.ErrorIs(t, err, pgparked.ErrBusy)
	close(release)
	wg.Wait()
}
