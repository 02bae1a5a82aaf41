// Package strictjson decodes JSON the way an API that refuses to guess
// should: exactly one value, valid UTF-8, no duplicate keys, field names
// spelt exactly as declared, no NUL in strings (PostgreSQL's text and
// jsonb cannot hold it), and errors that name the field and say what is
// wrong in words a caller can act on, never a Go type name.
//
// It is written here because encoding/json accepts each of those silently
// (it replaces invalid UTF-8 with U+FFFD, keeps the last duplicate, matches
// names case-insensitively), and encoding/json/v2, which refuses most of
// them, is still behind GOEXPERIMENT in Go 1.26. The walk below only
// checks; encoding/json still does the decoding.
package strictjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Options adjust Decode.
type Options struct {
	// AllowUnknownFields accepts object keys that match no field of the
	// target struct (events that gained a field); default is to refuse them.
	AllowUnknownFields bool
}

// Error is one problem with the input, at Path ("" for the whole value,
// "amount", "items[2].sku").
type Error struct {
	Path string
	Msg  string
}

func (e *Error) Error() string {
	if e.Path == "" {
		return e.Msg
	}
	return e.Path + ": " + e.Msg
}

// Decode checks data and decodes it into v, a non-nil pointer. Every error
// is an *Error.
func Decode(data []byte, v any, opts Options) error {
	if !utf8.Valid(data) {
		return &Error{Msg: "the JSON is not valid UTF-8"}
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	t := reflect.TypeOf(v)
	if t == nil || t.Kind() != reflect.Pointer {
		return &Error{Msg: "strictjson: Decode needs a pointer"}
	}
	if err := walk(dec, t.Elem(), "", opts); err != nil {
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return &Error{Msg: "there is data after the JSON value (exactly one value is allowed)"}
	}
	jd := json.NewDecoder(bytes.NewReader(data))
	if !opts.AllowUnknownFields {
		jd.DisallowUnknownFields()
	}
	if err := jd.Decode(v); err != nil {
		return translate(err)
	}
	return nil
}

func walk(dec *json.Decoder, t reflect.Type, path string, opts Options) error {
	tok, err := dec.Token()
	if err != nil {
		return syntaxError(err, dec)
	}
	t = deref(t)
	switch tok := tok.(type) {
	case string:
		if strings.ContainsRune(tok, 0) {
			return &Error{Path: path, Msg: `holds a NUL character (\u0000), which cannot be stored`}
		}
	case json.Delim:
		switch tok {
		case '{':
			return walkObject(dec, t, path, opts)
		case '[':
			var elem reflect.Type
			if t != nil && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) {
				elem = t.Elem()
			}
			for i := 0; dec.More(); i++ {
				if err := walk(dec, elem, path+"["+strconv.Itoa(i)+"]", opts); err != nil {
					return err
				}
			}
			if _, err := dec.Token(); err != nil {
				return syntaxError(err, dec)
			}
		}
	}
	return nil
}

func walkObject(dec *json.Decoder, t reflect.Type, path string, opts Options) error {
	var fields map[string]reflect.Type
	if t != nil && t.Kind() == reflect.Struct {
		fields = structFields(t)
	}
	seen := map[string]bool{}
	for dec.More() {
		kt, err := dec.Token()
		if err != nil {
			return syntaxError(err, dec)
		}
		key, _ := kt.(string)
		child := join(path, key)
		if strings.ContainsRune(key, 0) {
			return &Error{Path: path, Msg: `a key holds a NUL character (\u0000)`}
		}
		if seen[key] {
			return &Error{Path: child, Msg: "is given twice"}
		}
		seen[key] = true
		var ct reflect.Type
		switch {
		case fields != nil:
			ft, ok := fields[key]
			if !ok {
				for name := range fields {
					if strings.EqualFold(name, key) {
						return &Error{Path: child, Msg: fmt.Sprintf("unknown field (did you mean %q? names are case-sensitive)", name)}
					}
				}
				if !opts.AllowUnknownFields {
					return &Error{Path: child, Msg: "unknown field"}
				}
			}
			ct = ft
		case t != nil && t.Kind() == reflect.Map:
			ct = t.Elem()
		}
		if err := walk(dec, ct, child, opts); err != nil {
			return err
		}
	}
	if _, err := dec.Token(); err != nil {
		return syntaxError(err, dec)
	}
	return nil
}

// structFields maps the JSON names of t's fields (embedded structs
// flattened, as encoding/json does) to their types.
func structFields(t reflect.Type) map[string]reflect.Type {
	out := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
		if f.Anonymous && name == "" {
			if ft := deref(f.Type); ft.Kind() == reflect.Struct {
				for k, v := range structFields(ft) {
					if _, ok := out[k]; !ok {
						out[k] = v
					}
				}
				continue
			}
		}
		if !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		out[name] = f.Type
	}
	return out
}

func deref(t reflect.Type) reflect.Type {
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func syntaxError(err error, dec *json.Decoder) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return &Error{Msg: "the JSON ends too early"}
	}
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return &Error{Msg: fmt.Sprintf("invalid JSON at byte %d: %s", se.Offset, se.Error())}
	}
	return &Error{Msg: fmt.Sprintf("invalid JSON at byte %d", dec.InputOffset())}
}

// translate turns encoding/json's errors (which name Go types) into an *Error.
func translate(err error) error {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		msg := "must be " + describe(te.Type)
		if te.Value != "" {
			msg += ", got " + te.Value
		}
		return &Error{Path: te.Field, Msg: msg}
	}
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return &Error{Msg: fmt.Sprintf("invalid JSON at byte %d: %s", se.Offset, se.Error())}
	}
	if f, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
		name, _ := strconv.Unquote(f)
		return &Error{Path: name, Msg: "unknown field"}
	}
	return &Error{Msg: "the value does not fit: " + strings.TrimPrefix(err.Error(), "json: ")}
}

func describe(t reflect.Type) string {
	t = deref(t)
	if t == nil {
		return "a value"
	}
	switch t.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "a whole number in range"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Struct, reflect.Map:
		return "an object"
	}
	return "a value of another kind"
}
