package console

import (
	"bytes"
	"encoding/json"

	"github.com/ferry-dev/ferry/pipeline"
)

// asCurrent is a stored event shown as its event type's current version:
// what the handler will see if it is requeued or retried, or why it will
// refuse it.
type asCurrent struct {
	Shown            bool
	From, To         string
	Payload, Refusal string
}

// upcast shows payload, stored as the version its headers name, as the
// current version of its topic's chain (Config.Events), when there is one
// and the versions differ.
func (c *Console) upcast(topic string, headers map[string]string, payload []byte) asCurrent {
	if t := headers[pipeline.MetaOriginalTopic]; t != "" {
		topic = t // a durable retry
	}
	for _, e := range c.cfg.Events {
		if e.Name() != topic {
			continue
		}
		v := headers[pipeline.MetaSchemaVersion]
		if v == e.Current() {
			return asCurrent{}
		}
		out := asCurrent{Shown: true, From: v, To: e.Current()}
		up, err := e.Upcast(v, payload)
		if err == nil {
			err = e.Verify(v, payload)
		}
		if err != nil {
			out.Refusal = err.Error()
			return out
		}
		up = c.masked(up)
		var pretty bytes.Buffer
		if json.Indent(&pretty, up, "", "  ") == nil {
			out.Payload = pretty.String()
		} else {
			out.Payload = string(up)
		}
		return out
	}
	return asCurrent{}
}
