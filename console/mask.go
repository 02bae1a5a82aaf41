package console

import (
	"bytes"
	"encoding/json"
	"strings"
)

// masked is payload as reader pages show it: with Config.MaskFields set,
// the values of those JSON object keys (at any depth, any case) replaced
// by "<masked>"; a payload that is not JSON cannot be masked by field and
// is hidden whole. Written here because the masking is a page's concern:
// the stores keep the payload as published, since a requeue must send it
// back byte for byte.
func (c *Console) masked(payload []byte) []byte {
	if len(c.cfg.MaskFields) == 0 || len(payload) == 0 {
		return payload
	}
	d := json.NewDecoder(bytes.NewReader(payload))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil || d.More() {
		return []byte("<hidden: not JSON, and FERRY_CONSOLE_MASK_FIELDS masks payload fields>")
	}
	var out bytes.Buffer
	enc := json.NewEncoder(&out)
	enc.SetEscapeHTML(false) // the page escapes; "<masked>" reads as it is
	if err := enc.Encode(c.mask(v)); err != nil {
		return []byte("<hidden>")
	}
	return bytes.TrimSuffix(out.Bytes(), []byte("\n"))
}

func (c *Console) mask(v any) any {
	switch v := v.(type) {
	case map[string]any:
		for k, x := range v {
			if c.maskedField(k) {
				v[k] = "<masked>"
			} else {
				v[k] = c.mask(x)
			}
		}
	case []any:
		for i, x := range v {
			v[i] = c.mask(x)
		}
	}
	return v
}

func (c *Console) maskedField(k string) bool {
	for _, f := range c.cfg.MaskFields {
		if strings.EqualFold(f, k) {
			return true
		}
	}
	return false
}
