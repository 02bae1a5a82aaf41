package tracing_test

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/tracing"
)

// A failed attempt is an error span, and each attempt of a delivery is its
// own span: a head held in process through two failed tries and a third
// that passes shows three attempt spans, two of them errors. A delivery
// acked because its durable retry was scheduled (the failure recorded on
// the message) is an error span too, not UNSET.
func TestEveryAttemptIsASpanAndAFailureIsAnError(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tr := tracing.New(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	tries := 0
	handler := func(*message.Message) ([]*message.Message, error) {
		if tries++; tries < 3 {
			return nil, errors.New("provider answered 503")
		}
		return nil, nil
	}
	// What the durable retry does for a held partition: try, wait, try.
	holding := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			for {
				if _, err := h(msg); err == nil {
					return nil, nil
				}
				msg.Metadata.Set(pipeline.MetaAttempt, "2")
				time.Sleep(time.Millisecond)
			}
		}
	}
	_, err := tr.Consumer(holding(tr.Attempt(handler)))(message.NewMessage("m-1", []byte(`{}`)))
	require.NoError(t, err)
	spans := rec.Ended()
	require.Len(t, spans, 4)
	var failed, passed int
	for _, s := range spans[:3] {
		require.Contains(t, s.Name(), "attempt")
		require.Equal(t, spans[3].SpanContext().SpanID(), s.Parent().SpanID(), "a child of the consumer span")
		if s.Status().Code == codes.Error {
			failed++
		} else {
			passed++
		}
	}
	require.Equal(t, 2, failed)
	require.Equal(t, 1, passed)
	require.Equal(t, codes.Unset, spans[3].Status().Code, "the delivery succeeded in the end")

	// A durable retry scheduled: the handler's error is gone, the failure
	// is on the message.
	rec2 := tracetest.NewSpanRecorder()
	tr2 := tracing.New(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec2)))
	scheduled := func(msg *message.Message) ([]*message.Message, error) {
		msg.Metadata.Set(pipeline.MetaLastFailedAt, time.Now().String())
		msg.Metadata.Set(pipeline.MetaLastError, "SMTP 451")
		return nil, nil
	}
	_, err = tr2.Consumer(scheduled)(message.NewMessage("m-2", []byte(`{}`)))
	require.NoError(t, err)
	require.Equal(t, codes.Error, rec2.Ended()[0].Status().Code)
	require.Contains(t, rec2.Ended()[0].Status().Description, "SMTP 451")
}

// The request's X-Correlation-ID reaches the events the request publishes
// and comes back in the response; a missing or unusable one is replaced
// by an id made here, never passed on as it came.
func TestHTTPCarriesTheRequestsCorrelationIDToItsEvents(t *testing.T) {
	tr := tracing.New(nil)
	var got string
	h := tr.HTTP("create", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		msg, err := pipeline.NewEvent(r.Context(), "order-1", map[string]int{"n": 1})
		require.NoError(t, err)
		got = msg.Metadata.Get(pipeline.MetaCorrelationID)
	}))
	for _, tc := range []struct {
		sent string
		kept bool
	}{{"req-42", true}, {"", false}, {"has space", false}, {strings.Repeat("x", 129), false}} {
		req := httptest.NewRequest(http.MethodPost, "/orders", nil)
		if tc.sent != "" {
			req.Header.Set(tracing.CorrelationHeader, tc.sent)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		require.NotEmpty(t, got)
		require.Equal(t, got, rec.Header().Get(tracing.CorrelationHeader), "the response names the id the events carry")
		if tc.kept {
			require.Equal(t, tc.sent, got)
		} else {
			require.NotEqual(t, tc.sent, got)
		}
	}
}
