package chaos

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/evolve"
	"github.com/ferry-dev/ferry/examples/orders/charge"
	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
)

// The version roll (ChaosRun.Versions) takes the charge event through
// three versions while orders flow: version 1 is orders.ChargeRequested;
// version 2 nests the amount with its currency; version 3 nests the
// customer too. Each version's code reads the others through its chain:
// up steps for the older ones, down steps (shipped ahead, as a rolling
// deploy needs) for the newer ones.

type chargeMoney struct {
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

type chargeV2 struct {
	OrderID int64       `json:"order_id"`
	UserID  string      `json:"user_id"`
	Money   chargeMoney `json:"money"`
}

type chargeCustomer struct {
	ID string `json:"id"`
}

type chargeV3 struct {
	OrderID  int64          `json:"order_id"`
	Customer chargeCustomer `json:"customer"`
	Money    chargeMoney    `json:"money"`
}

func chargeUp1(e orders.ChargeRequested) (chargeV2, error) {
	return chargeV2{OrderID: e.OrderID, UserID: e.UserID, Money: chargeMoney{Amount: e.Amount, Currency: e.Currency}}, nil
}

func chargeUp2(e chargeV2) (chargeV3, error) {
	return chargeV3{OrderID: e.OrderID, Customer: chargeCustomer{ID: e.UserID}, Money: e.Money}, nil
}

func chargeDown3(e chargeV3) (chargeV2, error) {
	return chargeV2{OrderID: e.OrderID, UserID: e.Customer.ID, Money: e.Money}, nil
}

func chargeDown2(e chargeV2) (orders.ChargeRequested, error) {
	return orders.ChargeRequested{OrderID: e.OrderID, UserID: e.UserID, Amount: e.Money.Amount, Currency: e.Money.Currency}, nil
}

// VersionBugText is the reason version 1's code poisons a charge of a
// multiple of 97: a bug version 3 does not have, so that the run requeues
// version 1 events poisoned by version 1 code after version 3 is deployed.
const VersionBugText = "version 1 cannot charge a multiple of 97"

// versionBug is version 1's charger: the bug, then the provider.
type versionBug struct{ charge.Charger }

func (v versionBug) Charge(ctx context.Context, req charge.Request, key string) (string, error) {
	if req.Amount%97 == 0 {
		return "", pipeline.Permanent(errors.New(VersionBugText))
	}
	return v.Charger.Charge(ctx, req, key)
}

// chargeRoute is the stripe.charge route of version v's code.
func chargeRoute(v int, c charge.Charger, d app.Deps) (handlers.Route, error) {
	switch v {
	case 1:
		chain, err := evolve.New[orders.ChargeRequested](orders.TopicChargeRequested, "1",
			evolve.Down("3", "2", chargeDown3), evolve.Down("2", "1", chargeDown2))
		if err != nil {
			return handlers.Route{}, err
		}
		return charge.RouteOf(chain, func(e *orders.ChargeRequested) orders.ChargeRequested { return *e }, versionBug{c}, d.Logger), nil
	case 2:
		chain, err := evolve.New[chargeV2](orders.TopicChargeRequested, "2", evolve.Up("1", "2", chargeUp1), evolve.Down("3", "2", chargeDown3))
		if err != nil {
			return handlers.Route{}, err
		}
		return charge.RouteOf(chain, func(e *chargeV2) orders.ChargeRequested { o, _ := chargeDown2(*e); return o }, c, d.Logger), nil
	case 3:
		chain, err := evolve.New[chargeV3](orders.TopicChargeRequested, "3", evolve.Up("1", "2", chargeUp1), evolve.Up("2", "3", chargeUp2))
		if err != nil {
			return handlers.Route{}, err
		}
		return charge.RouteOf(chain, func(e *chargeV3) orders.ChargeRequested {
			v2, _ := chargeDown3(*e)
			o, _ := chargeDown2(v2)
			return o
		}, c, d.Logger), nil
	}
	return handlers.Route{}, fmt.Errorf("event version %d: want 1, 2 or 3", v)
}

// ParseEventVersion reads FERRY_CHAOS_EVENT_VERSION.
func ParseEventVersion(s string) (int, error) {
	v, err := strconv.Atoi(s)
	if err != nil || v < 1 || v > 3 {
		return 0, fmt.Errorf("want 1, 2 or 3, got %q", s)
	}
	return v, nil
}

// WithEventVersion makes the application version v's code of the version
// roll: its stripe.charge route reads the charge event through that
// version's chain.
func WithEventVersion(opts app.Options, v int, paymentURL string) app.Options {
	routes := opts.Routes
	opts.Routes = func(d app.Deps) ([]handlers.Route, error) {
		rs, err := routes(d)
		if err != nil {
			return nil, err
		}
		payments, err := charge.NewHTTPClient(paymentURL)
		if err != nil {
			return nil, err
		}
		for i, r := range rs {
			if r.Name == charge.HandlerName {
				if rs[i], err = chargeRoute(v, payments, d); err != nil {
					return nil, err
				}
			}
		}
		return rs, nil
	}
	return opts
}

// chargeEventOf is what version v's producers publish.
func chargeEventOf(v int) (orders.ChargeEventFunc, error) {
	switch v {
	case 1:
		return nil, nil // the example's own: orders.ChargeEvents, version 1
	case 2:
		chain, err := evolve.New[chargeV2](orders.TopicChargeRequested, "2", evolve.Up("1", "2", chargeUp1))
		if err != nil {
			return nil, err
		}
		return func(ctx context.Context, agg string, e orders.ChargeRequested) (*message.Message, error) {
			v2, _ := chargeUp1(e)
			return chain.NewEvent(ctx, agg, v2)
		}, nil
	case 3:
		chain, err := evolve.New[chargeV3](orders.TopicChargeRequested, "3", evolve.Up("1", "2", chargeUp1), evolve.Up("2", "3", chargeUp2))
		if err != nil {
			return nil, err
		}
		return func(ctx context.Context, agg string, e orders.ChargeRequested) (*message.Message, error) {
			v2, _ := chargeUp1(e)
			v3, _ := chargeUp2(v2)
			return chain.NewEvent(ctx, agg, v3)
		}, nil
	}
	return nil, fmt.Errorf("event version %d: want 1, 2 or 3", v)
}
