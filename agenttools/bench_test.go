package agenttools_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
)

// BenchmarkRunnerCall is a keyed call of a tool with one INSERT and one
// intent, its round trips included (go test -bench RunnerCall ./tools).
func BenchmarkRunnerCall(b *testing.B) {
	r, _ := setup(b, note(b, 0))
	ctx := context.Background()
	i := 0
	for b.Loop() {
		i++
		if _, err := r.Call(ctx, "note", fmt.Sprintf("k-%d", i), json.RawMessage(`{"text":"a"}`)); err != nil {
			b.Fatal(err)
		}
	}
}
