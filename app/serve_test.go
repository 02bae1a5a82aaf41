package app_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/ferrytest"
	"github.com/ferry-dev/ferry/handlers"
)

// The console of a process without a broker connection (ferry serve of
// a producing service) reads the broker on a connection of its own, as
// ferry status does: its unrouted card and queues say what the broker
// says (here: the topology not declared yet, the mail queue's state),
// never a blank card.
func TestAConsoleWithoutABrokerConnectionStillShowsTheBroker(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := ferrytest.AppConfig(ferrytest.Schema(t), ferrytest.Rabbit(t))
	cfg.ConsoleOpenReads = true // read from loopback without a login, as the operator chose
	routes := func(app.Deps) ([]handlers.Route, error) {
		return []handlers.Route{{Name: "mail.send", Topic: "mail.requested", Handler: handlers.Typed(func(context.Context, *struct{}) error { return nil })}}, nil
	}
	a, err := app.New(ctx, cfg, app.Options{Migrate: true, WithoutBroker: true, Routes: routes})
	require.NoError(t, err)
	defer a.Close()
	srv := httptest.NewServer(a.AdminHandler())
	defer srv.Close()
	get := func() string {
		resp, err := srv.Client().Get(srv.URL + "/console/overview")
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
		return string(b)
	}
	require.Contains(t, get(), "unrouted<b>none yet (no relay has declared the topology)</b>")

	// Once the topology is declared, the card shows the depth.
	declarer, err := app.New(ctx, cfg, app.Options{Routes: routes})
	require.NoError(t, err)
	ferrytest.TeardownTopology(t, declarer.Topology())
	defer declarer.Close()
	require.Contains(t, get(), "unrouted<b>0</b>")
}
