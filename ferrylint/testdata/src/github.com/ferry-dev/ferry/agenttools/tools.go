// Package tools is a stub of Ferry's tools package for the analyzer's tests.
package agenttools

import (
	"context"

	"github.com/jackc/pgx/v5"
)

type Def struct{ Name, Description string }

type Emitter struct{}

func (e *Emitter) Emit(ctx context.Context, topic, aggregateID string, payload any) (string, error) {
	return "", nil
}

type Tool interface{}

func New[In, Out any](d Def, body func(ctx context.Context, tx pgx.Tx, emit *Emitter, in In) (Out, error)) (Tool, error) {
	return nil, nil
}
