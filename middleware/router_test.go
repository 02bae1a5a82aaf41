package middleware_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
)

// deliver runs h, wrapped in mws (outermost first), as the handler named
// name on a real Watermill router over its in-memory Pub/Sub, and delivers
// msgs one after another, returning what the chain answered for each. The
// handler sees what it sees in production: its handler name and the
// subscribed topic in its context. Each delivery is acked whatever the
// chain answered, so the in-memory Pub/Sub redelivers nothing by itself:
// a test delivers again by passing the message again.
func deliver(t *testing.T, name string, mws []message.HandlerMiddleware, h message.HandlerFunc, msgs ...*message.Message) []error {
	t.Helper()
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	defer pubsub.Close()
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		t.Fatal(err)
	}
	results := make(chan error, 1)
	handler := router.AddConsumerHandler(name, "topic", pubsub, func(m *message.Message) error {
		_, err := h(m)
		return err
	})
	handler.AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			_, err := next(m)
			results <- err
			return nil, nil
		}
	})
	handler.AddMiddleware(mws...)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	go func() { _ = router.Run(ctx) }()
	defer router.Close()
	<-router.Running()
	var out []error
	for _, m := range msgs {
		// A copy per delivery, as a broker hands out: the chain may set
		// metadata on what it was given.
		c := m.Copy()
		if err := pubsub.Publish("topic", c); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-results:
			out = append(out, err)
		case <-ctx.Done():
			t.Fatalf("handler %s did not answer", name)
		}
	}
	return out
}

// handlerContext returns the context a real router gives the messages of
// the handler named name (its handler name in it), for a test that calls
// a handler directly and concurrently, as a route with many workers does.
// The router runs until the test ends.
func handlerContext(t *testing.T, name string) context.Context {
	t.Helper()
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan context.Context, 1)
	// The handler holds its message until the test ends: the router
	// cancels a message's context once its handler returns.
	release := make(chan struct{})
	router.AddConsumerHandler(name, "ctx", pubsub, func(m *message.Message) error {
		got <- m.Context()
		<-release
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	go func() { _ = router.Run(ctx) }()
	t.Cleanup(func() { close(release); cancel(); _ = router.Close(); _ = pubsub.Close() })
	<-router.Running()
	if err := pubsub.Publish("ctx", message.NewMessage("ctx", nil)); err != nil {
		t.Fatal(err)
	}
	return <-got
}
