package handlers

import (
	"errors"
	"fmt"
	"regexp"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/ferry-dev/ferry/pipeline"
)

// Route is one consumer handler. The application's route table, a []Route,
// is its contents page: every handler, its topic, whether it needs order,
// and its own middleware.
type Route struct {
	// Name identifies the handler: its queue and its ledger key. Stable.
	Name string
	// Topic is the event topic the handler consumes.
	Topic string
	// Ordered marks handlers that need events of one aggregate in outbox
	// order (a charge and its refund). Recorded in the route table now; the
	// relay and partitioned queues honour it.
	Ordered bool
	// Handler processes one message. Return nil only when its effect is done.
	Handler message.NoPublishHandlerFunc
	// Middleware wraps only this handler, inside the router-wide chain
	// (inside the idempotency transaction).
	Middleware []message.HandlerMiddleware
}

var validName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$`)

// Validate reports every problem of r at once.
func (r Route) Validate() error {
	var errs []error
	if !validName.MatchString(r.Name) {
		errs = append(errs, fmt.Errorf("route name %q must match %s", r.Name, validName))
	}
	if !validName.MatchString(r.Topic) {
		errs = append(errs, fmt.Errorf("route %q: topic %q must match %s", r.Name, r.Topic, validName))
	} else if err := pipeline.ValidateTopicName(r.Topic); err != nil {
		errs = append(errs, fmt.Errorf("route %q: %w", r.Name, err))
	}
	if r.Handler == nil {
		errs = append(errs, fmt.Errorf("route %q has no handler", r.Name))
	}
	return errors.Join(errs...)
}

// ValidateRoutes checks every route and that names are unique.
func ValidateRoutes(routes []Route) error {
	var errs []error
	seen := make(map[string]bool, len(routes))
	for _, r := range routes {
		if err := r.Validate(); err != nil {
			errs = append(errs, err)
		}
		if seen[r.Name] {
			errs = append(errs, fmt.Errorf("route name %q is used twice", r.Name))
		}
		seen[r.Name] = true
	}
	return errors.Join(errs...)
}
