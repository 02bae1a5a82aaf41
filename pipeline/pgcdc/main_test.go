package pgcdc_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/ferry-dev/ferry/pipeline/pgcdc"
	"github.com/ferry-dev/ferry/pipeline/pgdb"
	"github.com/ferry-dev/ferry/pipeline/pgoutbox"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// childEnv makes the test binary a CDC relay process (for the SIGKILL
// test) instead of running tests: FERRY_CDC_CHILD="schema slot namespace".
const childEnv = "FERRY_CDC_CHILD"

func TestMain(m *testing.M) {
	if spec := os.Getenv(childEnv); spec != "" {
		if err := runChild(spec); err != nil {
			fmt.Fprintln(os.Stderr, "cdc child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func runChild(spec string) error {
	var schema, slot, namespace string
	if _, err := fmt.Sscan(spec, &schema, &slot, &namespace); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	pool, err := pgdb.Open(ctx, pgdb.Config{URL: pipelinetest.DatabaseURL(), Schema: schema, ApplicationName: "ferry-cdc-child"})
	if err != nil {
		return err
	}
	defer pool.Close()
	cfg := rabbit.Config{URL: pipelinetest.AMQPURL(), Namespace: namespace, OrderedTopics: []string{orderedTopic}, Partitions: 1}
	topo, err := rabbit.NewTopology(cfg)
	if err != nil {
		return err
	}
	conn, err := rabbit.Dial(cfg, "ferry-cdc-child", watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer conn.Close()
	pub, err := rabbit.NewBatchPublisher(conn, topo)
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	relay, err := pgoutbox.NewRelay(pool, pub, pgoutbox.RelayConfig{Table: testTable, OrderedTopics: pub.OrderedTopics()}, logger)
	if err != nil {
		return err
	}
	s, err := pgcdc.NewStreamer(pool, relay, testTable, pgcdc.Config{Slot: slot, StatusInterval: time.Second, StandbyRetry: 100 * time.Millisecond, BatchSize: 50, InFlight: 4}, logger)
	if err != nil {
		return err
	}
	return s.Run(ctx)
}
