package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/ferry-dev/ferry/app"
	"github.com/ferry-dev/ferry/evolve"
)

// ScenarioUpcast times what an event version step costs a handler: the
// decode of a 1 KiB event stored as version 1 through two steps, against
// the decode of the same JSON stored as the current version.
const ScenarioUpcast = "upcast"

// Three versions with the same fields under different types: the decode
// is the same work for each, so the difference is the steps.
type upcastV1 struct {
	ID    string   `json:"id"`
	Cents int64    `json:"cents"`
	Email string   `json:"email"`
	Lines []string `json:"lines"`
}

type upcastV2 upcastV1

type upcastV3 upcastV1

// upcastRounds interleaves the variants, so that a noisy machine slows
// them alike; the median round is reported.
const upcastRounds = 7

func benchUpcast(_ context.Context, _ app.Config, bc BenchConfig, _ *slog.Logger) (benchReport, error) {
	typed, err := evolve.New[upcastV3]("bench.upcast", "3",
		evolve.Up("1", "2", func(v upcastV1) (upcastV2, error) { return upcastV2(v), nil }),
		evolve.Up("2", "3", func(v upcastV2) (upcastV3, error) { return upcastV3(v), nil }))
	if err != nil {
		return benchReport{}, err
	}
	// A raw step that renames a field, as one does for a version whose
	// Go type is gone: a map round trip of the whole payload.
	rename := func(from, to string) func(json.RawMessage) (json.RawMessage, error) {
		return func(raw json.RawMessage) (json.RawMessage, error) {
			var m map[string]any
			if err := json.Unmarshal(raw, &m); err != nil {
				return nil, err
			}
			m[to] = m[from]
			delete(m, from)
			return json.Marshal(m)
		}
	}
	raw, err := evolve.New[upcastV3]("bench.upcast", "3", evolve.Raw("1", "2", rename("email", "mail")), evolve.Raw("2", "3", rename("mail", "email")))
	if err != nil {
		return benchReport{}, err
	}
	lines := make([]string, 20)
	for i := range lines {
		lines[i] = fmt.Sprintf("sku-%04d x %d", i, i+1)
	}
	payload, _ := json.Marshal(upcastV1{ID: "order-000001", Cents: 12_345, Email: strings.Repeat("a", 660) + "@example.com", Lines: lines})
	time1 := func(decode func() error) (time.Duration, error) {
		n := bc.UpcastIterations
		start := time.Now()
		for range n {
			if err := decode(); err != nil {
				return 0, err
			}
		}
		return time.Since(start) / time.Duration(n), nil
	}
	var current, typedHops, rawHops []time.Duration
	for range upcastRounds {
		for _, v := range []struct {
			into   *[]time.Duration
			decode func() error
		}{
			{&current, func() error { _, err := typed.Decode("3", payload); return err }},
			{&typedHops, func() error { _, err := typed.Decode("1", payload); return err }},
			{&rawHops, func() error { _, err := raw.Decode("1", payload); return err }},
		} {
			d, err := time1(v.decode)
			if err != nil {
				return benchReport{}, err
			}
			*v.into = append(*v.into, d)
		}
	}
	median := func(ds []time.Duration) time.Duration { slices.Sort(ds); return ds[len(ds)/2] }
	cur, th, rh := median(current), median(typedHops), median(rawHops)
	perTyped := max(th-cur, 0) / 2
	perRaw := max(rh-cur, 0) / 2
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1000 }
	rep := benchReport{JSON: map[string]any{
		"payload_bytes":        len(payload),
		"decode_current_us":    us(cur),
		"decode_two_typed_us":  us(th),
		"decode_two_raw_us":    us(rh),
		"typed_hop_us":         us(perTyped),
		"raw_rename_hop_us":    us(perRaw),
		"typed_hop_goal_met":   perTyped <= 5*time.Microsecond,
		"rounds_median_of":     upcastRounds,
		"iterations_per_round": 2_000,
	}}
	rep.Table = fmt.Sprintf("a %d-byte event, median of %d rounds:\n  decode as the current version   %8.1f µs\n  from version 1, two typed steps %8.1f µs  (%.2f µs a step; goal ≤ 5)\n  from version 1, two raw renames %8.1f µs  (%.1f µs a step: a map round trip)\n",
		len(payload), upcastRounds, us(cur), us(th), us(perTyped), us(rh), us(perRaw))
	return rep, nil
}
