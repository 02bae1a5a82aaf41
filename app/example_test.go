package app_test

import (
	"context"
	"log"
	"os/signal"
	"syscall"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/middleware"
)

type userSignedUp struct {
	UserID string `json:"user_id"`
}

// An application registers its handlers in one route table and adds its own
// middleware at a chosen place of the chain, then runs everything.
func Example() {
	cfg, err := app.ConfigFromEnv()
	if err != nil {
		log.Fatal(err)
	}
	opts := app.Options{
		Routes: func(d app.Deps) ([]handlers.Route, error) {
			routes, err := app.ExampleRoutes(d) // keep the example's charge and mail handlers
			if err != nil {
				return nil, err
			}
			return append(routes, handlers.Route{
				Name:  "crm.sync-signup", // stable: names the queue and the ledger key
				Topic: "user.signed_up",
				Handler: handlers.Typed(func(ctx context.Context, e *userSignedUp) error {
					key, err := handlers.IdempotencyKey(ctx) // pass to the CRM's API
					_ = key
					return err
				}),
			}), nil
		},
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
