package pgoutbox

import (
	"encoding/json"
	"unicode/utf8"
)

// Written by hand because neither encoding/json nor pgx says what
// PostgreSQL's jsonb input will refuse: json.Valid accepts, and jsonb
// refuses, invalid UTF-8 inside a string (22021), a \u0000 escape (22P05),
// a lone UTF-16 surrogate escape (22P02) and a number out of numeric's
// range (22003). A refused value would abort the caller's transaction, so
// the outbox decides before it writes, and stores such a payload as bytes
// only. TestJSONBCanHoldAgreesWithPostgreSQL checks the rule against the
// server on random input.

// Bounds of PostgreSQL's numeric, which stores jsonb's numbers
// (src/backend/utils/adt/numeric.c): base-10000 digit weights up to
// NUMERIC_WEIGHT_MAX, a display scale up to NUMERIC_DSCALE_MAX, and an
// input exponent below INT_MAX/2.
const (
	numericWeightMax   = 32767
	numericDscaleMax   = 16383
	numericExponentMax = 1<<30 - 1
)

// maxJSONBDepth is the deepest nesting stored as jsonb. PostgreSQL's
// parser recurses per level against max_stack_depth, which a server may
// set as low as 100 kB: there PostgreSQL 15 refused a text cast of
// objects 630 deep and arrays 700 deep (measured in psql), and the
// outbox's insert refused objects 1,000 deep, aborting the caller's
// transaction (TestDeepPayloadsNeverAbortTheCallersTransaction). 256
// leaves room for the stack the statement itself uses (a trigger, a
// function around the insert); deeper payloads are kept as bytes, never
// risked.
const maxJSONBDepth = 256

// JSONBCanHold reports whether PostgreSQL's jsonb input accepts payload:
// valid JSON in valid UTF-8, no \u0000 escape, every surrogate escape part
// of a pair, every number within numeric's range, nesting within
// maxJSONBDepth. A payload it refuses is still published, stored as bytes
// (payload_raw) with the jsonb column NULL.
func JSONBCanHold(payload []byte) bool {
	if !utf8.Valid(payload) || !json.Valid(payload) {
		return false
	}
	depth := 0
	for i := 0; i < len(payload); {
		switch c := payload[i]; {
		case c == '"':
			end, ok := jsonbString(payload, i+1)
			if !ok {
				return false
			}
			i = end
		case c == '[' || c == '{':
			if depth++; depth > maxJSONBDepth {
				return false
			}
			i++
		case c == ']' || c == '}':
			depth--
			i++
		case c == '-' || c >= '0' && c <= '9':
			end := i + 1
			for end < len(payload) && numberByte(payload[end]) {
				end++
			}
			if !numericFits(payload[i:end]) {
				return false
			}
			i = end
		default:
			i++
		}
	}
	return true
}

func numberByte(c byte) bool {
	return c >= '0' && c <= '9' || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-'
}

// jsonbString checks the escapes of the string whose body starts at i
// (json.Valid has checked its syntax) and returns the index after its
// closing quote.
func jsonbString(b []byte, i int) (int, bool) {
	for i < len(b) {
		switch b[i] {
		case '"':
			return i + 1, true
		case '\\':
			if b[i+1] != 'u' {
				i += 2
				continue
			}
			r := hex4(b[i+2 : i+6])
			switch {
			case r == 0:
				return 0, false
			case r >= 0xD800 && r <= 0xDBFF:
				// A high surrogate stands only before a low one.
				if i+12 > len(b) || b[i+6] != '\\' || b[i+7] != 'u' {
					return 0, false
				}
				if lo := hex4(b[i+8 : i+12]); lo < 0xDC00 || lo > 0xDFFF {
					return 0, false
				}
				i += 12
			case r >= 0xDC00 && r <= 0xDFFF:
				return 0, false
			default:
				i += 6
			}
		default:
			i++
		}
	}
	return 0, false
}

func hex4(b []byte) rune {
	var r rune
	for _, c := range b {
		r <<= 4
		switch {
		case c >= '0' && c <= '9':
			r |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			r |= rune(c-'a') + 10
		case c >= 'A' && c <= 'F':
			r |= rune(c-'A') + 10
		}
	}
	return r
}

// numericFits reports whether numeric's input takes the JSON number num,
// as set_var_from_str and make_result decide: the exponent below
// INT_MAX/2, the display scale (fraction digits less the exponent) at
// most NUMERIC_DSCALE_MAX, and, for a value other than zero, the weight of
// its leading digit at most NUMERIC_WEIGHT_MAX.
func numericFits(num []byte) bool {
	i := 0
	if i < len(num) && num[i] == '-' {
		i++
	}
	intStart := i
	for i < len(num) && num[i] >= '0' && num[i] <= '9' {
		i++
	}
	intDigits := num[intStart:i]
	var fracDigits []byte
	if i < len(num) && num[i] == '.' {
		i++
		start := i
		for i < len(num) && num[i] >= '0' && num[i] <= '9' {
			i++
		}
		fracDigits = num[start:i]
	}
	var exp int64
	if i < len(num) && (num[i] == 'e' || num[i] == 'E') {
		i++
		neg := false
		if i < len(num) && (num[i] == '+' || num[i] == '-') {
			neg = num[i] == '-'
			i++
		}
		for ; i < len(num); i++ {
			if exp < numericExponentMax { // saturates: beyond it is refused anyway
				exp = exp*10 + int64(num[i]-'0')
			}
		}
		if neg {
			exp = -exp
		}
	}
	if exp >= numericExponentMax || exp <= -numericExponentMax {
		return false
	}
	if max(int64(len(fracDigits))-exp, 0) > numericDscaleMax {
		return false
	}
	lead := -1
	for k, c := range intDigits {
		if c != '0' {
			lead = k
			break
		}
	}
	if lead < 0 {
		for k, c := range fracDigits {
			if c != '0' {
				lead = len(intDigits) + k
				break
			}
		}
	}
	if lead < 0 {
		return true // zero: no weight to bound
	}
	decExp := int64(len(intDigits)-1-lead) + exp
	return floorDiv(decExp, 4) <= numericWeightMax
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && a < 0 {
		q--
	}
	return q
}
