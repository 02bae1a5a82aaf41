package orders_test

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferry-dev/ferry/examples/orders/orders"
	"github.com/ferry-dev/ferry/handlers"
	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// FuzzDecodeMessage: any delivery, however malformed, unmarshals without
// error (so it reaches the chain instead of looping on nack) and decodes to
// either a valid event or a Permanent error (so it is poisoned, never
// retried forever).
func FuzzDecodeMessage(f *testing.F) {
	f.Add([]byte(`{"order_id":1,"user_id":"u","amount":5,"currency":"JPY"}`), "1", "id-1")
	f.Add([]byte("not json"), "1", "id-2")
	f.Add([]byte(`{"order_id":1}`), "1", "")
	f.Add([]byte(`{"order_id":1,"user_id":"u","amount":5,"currency":"JPY"} trailing`), "2", "id-3")
	f.Add([]byte(`{"order_id":-1,"user_id":"","amount":0,"currency":"\u0000"}`), "", "id-4")
	f.Fuzz(func(t *testing.T, body []byte, version, id string) {
		msg, err := rabbit.Marshaler{}.Unmarshal(amqp.Delivery{
			MessageId: id, Body: body,
			Headers: amqp.Table{pipeline.MetaSchemaVersion: version, "x-delivery-count": int64(len(body))},
		})
		if err != nil {
			t.Fatalf("unmarshal refused a delivery: %v", err)
		}
		e, err := handlers.Decode[orders.ChargeRequested](msg)
		if err != nil {
			if !pipeline.IsPermanent(err) {
				t.Fatalf("a decode error must be permanent: %v", err)
			}
			return
		}
		if verr := e.Validate(); verr != nil {
			t.Fatalf("Decode returned an invalid event: %v", verr)
		}
	})
}
