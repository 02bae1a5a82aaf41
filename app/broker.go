package app

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferry-dev/ferry/pipeline"
	"github.com/ferry-dev/ferry/pipeline/rabbit"
)

// bindings is the broker topology of the route table.
func (a *App) bindings() []rabbit.Binding {
	var b []rabbit.Binding
	for _, r := range a.routes {
		b = append(b, rabbit.Binding{Topic: r.Topic, Queue: r.Name})
	}
	return b
}

// watermillLogger bridges to slog once; Watermill's Info lines (handler
// started, connection opened) are Debug here, its errors stay errors.
func (a *App) watermillLogger() watermill.LoggerAdapter {
	return watermill.NewSlogLoggerWithLevelMapping(a.logger, map[slog.Level]slog.Level{slog.LevelInfo: slog.LevelDebug})
}

// Broker is the publisher's broker connection (nil WithoutBroker), for
// tools that inspect, purge or tear down the topology.
func (a *App) Broker() *amqp.Connection {
	if a.pubConn == nil {
		return nil
	}
	return a.pubConn.Connection()
}

// UnroutedDepth is how many messages wait in the broker's unrouted queue
// (published to a topic no route consumes); they need a human.
func (a *App) UnroutedDepth(context.Context) (int, error) {
	conn, done, err := a.inspectConn()
	if err != nil {
		return 0, err
	}
	defer done()
	return rabbit.QueueDepth(conn, a.topology.QueueName(rabbit.UnroutedName))
}

// inspectConn is the connection UnroutedDepth and QueueStats read the
// broker on: the publisher's, or, for an app built WithoutBroker (ferry
// serve of a producing service), one of their own for the read, as `ferry
// status` opens, so that its console still shows the broker's state.
func (a *App) inspectConn() (*amqp.Connection, func(), error) {
	if a.pubConn != nil {
		return a.pubConn.Connection(), func() {}, nil
	}
	cfg := a.cfg.AMQP
	cfg.DialTimeout = 3 * time.Second
	uri, conf := rabbit.AMQPConfig(cfg, "ferry-console")
	conn, err := amqp.DialConfig(uri, conf)
	if err != nil {
		return nil, nil, fmt.Errorf("this process has no broker connection and could not open one to read the queues: %w", err)
	}
	return conn, func() { _ = conn.Close() }, nil
}

// QueueStats inspects the queues of the route table (each partition of an
// ordered route, the one queue of another): messages ready and consumers.
// A queue with messages and no consumer is where messages wait unseen.
func (a *App) QueueStats(context.Context) ([]rabbit.QueueStat, error) {
	conn, done, err := a.inspectConn()
	if err != nil {
		return nil, err
	}
	defer done()
	return a.QueueStatsOn(conn)
}

// QueueStatsOn is QueueStats over conn, for an app built WithoutBroker
// (ferry status reads the queues without declaring anything). A queue not
// declared yet is left out: no consumer of it has started.
func (a *App) QueueStatsOn(conn *amqp.Connection) ([]rabbit.QueueStat, error) {
	out := []rabbit.QueueStat{}
	seen := map[string]bool{}
	for _, r := range a.routes {
		for _, sub := range a.subscriptions(r) {
			if seen[sub.Queue] {
				continue
			}
			seen[sub.Queue] = true
			st, err := rabbit.QueueStats(conn, sub.Queue)
			switch {
			case rabbit.IsQueueMissing(err):
				continue
			case err != nil:
				return out, err
			}
			st.Handler = pipeline.ConsumerQueue(sub.Name)
			out = append(out, st)
		}
	}
	return out, nil
}

// Publisher is watermill-amqp's confirmed publisher on Ferry's topology
// (one confirm per message), for direct publishing to unordered topics.
func (a *App) Publisher() message.Publisher { return a.publisher }

// BatchPublisher is the relay's publisher: pipelined confirms, partition routing.
func (a *App) BatchPublisher() *rabbit.BatchPublisher { return a.batchPublisher }
