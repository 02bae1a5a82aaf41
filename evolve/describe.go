package evolve

import (
	"encoding"
	"encoding/json"
	"reflect"
	"strings"
	"time"
)

// Field is one JSON field of an event version: its JSON type and whether
// every event of that version has it.
type Field struct {
	// Type is the JSON type: string, integer, number, boolean, object,
	// array or any (a type that marshals itself, an interface).
	Type string `json:"type"`
	// Required is true for a field Go always writes (no omitempty or
	// omitzero, not a pointer): a reader may count on it.
	Required bool `json:"required"`
}

// Fields are a version's fields by path: "customer.email", "lines[].sku".
type Fields map[string]Field

// Describe returns the JSON fields of t as encoding/json writes them:
// exported fields by their json tag, embedded structs' fields inlined,
// nested structs as paths.
func Describe(t reflect.Type) Fields {
	out := Fields{}
	describe(t, "", true, out, map[reflect.Type]bool{})
	return out
}

var (
	jsonMarshaler = reflect.TypeFor[json.Marshaler]()
	textMarshaler = reflect.TypeFor[encoding.TextMarshaler]()
	timeType      = reflect.TypeFor[time.Time]()
)

func jsonType(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch {
	case t == timeType:
		return "string"
	case t.Implements(jsonMarshaler) || reflect.PointerTo(t).Implements(jsonMarshaler):
		return "any"
	case t.Implements(textMarshaler) || reflect.PointerTo(t).Implements(textMarshaler):
		return "string"
	}
	switch t.Kind() {
	case reflect.String:
		return "string"
	case reflect.Bool:
		return "boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "integer"
	case reflect.Float32, reflect.Float64:
		return "number"
	case reflect.Struct, reflect.Map:
		return "object"
	case reflect.Slice, reflect.Array:
		if t.Elem().Kind() == reflect.Uint8 {
			return "string" // base64
		}
		return "array"
	}
	return "any"
}

// describe adds t's fields under prefix. seen stops a recursive type.
func describe(t reflect.Type, prefix string, required bool, out Fields, seen map[reflect.Type]bool) {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if seen[t] || jsonType(t) != "object" && jsonType(t) != "array" {
		return
	}
	seen[t] = true
	defer delete(seen, t)
	switch t.Kind() {
	case reflect.Slice, reflect.Array:
		describe(t.Elem(), prefix+"[]", required, out, seen)
		return
	case reflect.Map:
		return // keys are data, not fields
	}
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" || !f.IsExported() && !f.Anonymous {
			continue
		}
		name, opts, _ := strings.Cut(tag, ",")
		if f.Anonymous && name == "" {
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				describe(ft, prefix, required && f.Type.Kind() != reflect.Pointer, out, seen)
				continue
			}
			if !f.IsExported() {
				continue
			}
		}
		if name == "" {
			name = f.Name
		}
		path := name
		if prefix != "" {
			path = prefix + "." + name
		}
		req := required && f.Type.Kind() != reflect.Pointer && !strings.Contains(","+opts+",", ",omitempty,") && !strings.Contains(","+opts+",", ",omitzero,")
		typ := jsonType(f.Type)
		if strings.Contains(","+opts+",", ",string,") {
			typ = "string"
		}
		out[path] = Field{Type: typ, Required: req}
		describe(f.Type, path, req, out, seen)
	}
}
