package app_test

import (
	"context"
	"log"
	"os/signal"
	"syscall"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/middleware"
)

type userSignedUp struct {
	UserID string `json:"user_id"`
}

// routes is an application's route table: its contents page.
func routes(d app.Deps) ([]handlers.Route, error) {
	return []handlers.Route{{
		Name:  "crm.sync-signup", // stable: names the queue and the ledger key
		Topic: "user.signed_up",
		Handler: handlers.Typed(func(ctx context.Context, e *userSignedUp) error {
			key, err := handlers.IdempotencyKey(ctx) // pass to the CRM's API
			_ = key
			return err
		}),
	}}, nil
}

// An application registers its handlers in one route table and adds its own
// middleware at a chosen place of the chain, then runs everything.
func Example() {
	cfg, err := app.ConfigFromEnv()
	if err != nil {
		log.Fatal(err)
	}
	opts := app.Options{
		Routes: routes,
		Chain: func(c middleware.Chain) (middleware.Chain, error) {
			return c.InsertAfter(middleware.LinkCorrelation, middleware.Link{
				Name: "audit",
				Middleware: func(h message.HandlerFunc) message.HandlerFunc {
					return func(msg *message.Message) ([]*message.Message, error) { return h(msg) }
				},
			})
		},
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	a, err := app.New(ctx, cfg, opts)
	if err != nil {
		log.Fatal(err)
	}
	defer a.Close()
	if err := a.Run(ctx, app.All, nil); err != nil {
		log.Fatal(err)
	}
}

// A Watermill user mounts the route table on the router they already run,
// beside handlers of their own; Ferry adds its chain per handler, nothing
// router-wide.
func ExampleApp_Mount() {
	cfg, err := app.ConfigFromEnv()
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	a, err := app.New(ctx, cfg, app.Options{Routes: routes})
	if err != nil {
		log.Fatal(err)
	}
	defer a.Close()

	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	consumers, err := a.Mount(router)
	if err != nil {
		log.Fatal(err)
	}
	defer consumers.Close() // after the router has stopped
	if err := router.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
