package snippets

import (
	"context"
	"encoding/json"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/evolve"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
)

// snippet:begin evolve-types
// OrderPlacedV1 is how the event looked a month ago: euros as a float.
type OrderPlacedV1 struct {
	OrderID string  `json:"order_id"`
	Euros   float64 `json:"euros"`
	Email   string  `json:"email"`
}

// OrderPlaced is the current version, 2: an amount in cents with its
// currency, the customer nested.
type OrderPlaced struct {
	OrderID  string   `json:"order_id"`
	Amount   Amount   `json:"amount"`
	Customer Customer `json:"customer"`
	Note     string   `json:"note,omitempty"` // added later: optional, no new version needed
}

type Amount struct {
	Cents    int64  `json:"cents"`
	Currency string `json:"currency"`
}

type Customer struct {
	Email string `json:"email"`
}

// snippet:end evolve-types

// snippet:begin evolve-chain
// OrderPlacedEvents is the event type's chain: version 2 is current, and
// one typed step brings version 1 events to it, wherever they waited.
var OrderPlacedEvents = mustChain(evolve.New[OrderPlaced]("orders.placed", "2",
	evolve.Up("1", "2", func(o OrderPlacedV1) (OrderPlaced, error) {
		return OrderPlaced{
			OrderID:  o.OrderID,
			Amount:   Amount{Cents: int64(o.Euros*100 + 0.5), Currency: "EUR"},
			Customer: Customer{Email: o.Email},
		}, nil
	}),
))

// snippet:end evolve-chain

// snippet:begin evolve-raw
// A step on the JSON itself, for a version whose Go type is gone (here a
// version 0 a service in another language wrote as "total", numbered 1
// when the chain was introduced).
var legacyTotal = evolve.Raw("1", "2", func(raw json.RawMessage) (json.RawMessage, error) {
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, err
	}
	m["amount"] = map[string]any{"cents": m["total"], "currency": "EUR"}
	delete(m, "total")
	return json.Marshal(m)
})

// snippet:end evolve-raw

func mustChain[T any](c *evolve.Chain[T], err error) *evolve.Chain[T] {
	if err != nil {
		panic(err) // a chain that cannot work stops the program at init, like regexp.MustCompile
	}
	return c
}

// snippet:begin evolve-use
func evolveOptions(ship func(context.Context, *OrderPlaced) error) app.Options {
	return app.Options{
		// `ferry schema check` compares these with the committed snapshot.
		Events: []evolve.Schema{OrderPlacedEvents},
		Routes: func(app.Deps) ([]handlers.Route, error) {
			return []handlers.Route{{
				Name:  "shipping.prepare",
				Topic: "orders.placed",
				// The handler sees version 2 only, whatever version the
				// event was written as.
				Handler: handlers.Evolving(OrderPlacedEvents, ship),
			}}, nil
		},
	}
}

func placeOrder(ctx context.Context, p *pgoutbox.Pending, o OrderPlaced) error {
	// Stamped with the chain's current version: never by hand.
	msg, err := OrderPlacedEvents.NewEvent(ctx, o.OrderID, o)
	if err != nil {
		return err
	}
	return p.PublishEvents(ctx, pipeline.Outgoing{Topic: "orders.placed", Msg: msg})
}

// snippet:end evolve-use

var _, _, _ = evolveOptions, placeOrder, legacyTotal
