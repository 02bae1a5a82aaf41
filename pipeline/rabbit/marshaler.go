package rabbit

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferry-dev/ferry/pipeline"
)

// Marshaler converts between Watermill messages and AMQP deliveries. Unlike
// watermill-amqp's DefaultMarshaler it never fails to unmarshal: a failed
// unmarshal makes the subscriber nack and requeue the delivery, forever,
// before any middleware (or the poison queue) sees it. Header values that
// are not strings, such as quorum queues' integer x-delivery-count, become
// their text form; a delivery without a message id keeps an empty UUID and
// is rejected, with a reason, by the consumer middleware.
type Marshaler struct{}

var _ wamqp.Marshaler = Marshaler{}

// Marshal makes a persistent publishing carrying the metadata as headers
// and the message UUID both as a header and as the AMQP message-id.
func (Marshaler) Marshal(msg *message.Message) (amqp.Publishing, error) {
	p, err := wamqp.DefaultMarshaler{}.Marshal(msg)
	if err != nil {
		return p, err
	}
	p.MessageId = msg.UUID
	// Payloads are any bytes, delivered as published; say which are JSON.
	p.ContentType = "application/octet-stream"
	if json.Valid(msg.Payload) {
		p.ContentType = "application/json"
	}
	p.CorrelationId = msg.Metadata.Get(pipeline.MetaCorrelationID)
	p.Timestamp = time.Now()
	return p, nil
}

// Unmarshal never returns an error; see Marshaler.
func (Marshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	id := ""
	if v, ok := d.Headers[wamqp.DefaultMessageUUIDHeaderKey]; ok {
		id = headerText(v)
	}
	if id == "" {
		id = d.MessageId
	}
	msg := message.NewMessage(id, d.Body)
	for k, v := range d.Headers {
		if k == wamqp.DefaultMessageUUIDHeaderKey {
			continue
		}
		msg.Metadata.Set(k, headerText(v))
	}
	if msg.Metadata.Get(pipeline.MetaCorrelationID) == "" && d.CorrelationId != "" {
		msg.Metadata.Set(pipeline.MetaCorrelationID, d.CorrelationId)
	}
	return msg, nil
}

func headerText(v any) string {
	switch x := v.(type) {
	case string:
		return x
	case []byte:
		return string(x)
	case int:
		return strconv.Itoa(x)
	case int8, int16, int32, int64, uint8, uint16, uint32, uint64:
		return fmt.Sprint(x)
	case bool:
		return strconv.FormatBool(x)
	case float32, float64:
		return fmt.Sprint(x)
	case time.Time:
		return x.UTC().Format(time.RFC3339Nano)
	case nil:
		return ""
	default:
		b, err := json.Marshal(x)
		if err != nil {
			return fmt.Sprint(x)
		}
		return string(b)
	}
}
