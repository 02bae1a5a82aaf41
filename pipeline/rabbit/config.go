package rabbit

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferry-dev/ferry/pipeline"
)

// Defaults and bounds of Config.
const (
	DefaultURL             = "amqp://guest:guest@127.0.0.1:5672/"
	DefaultPublishChannels = 4
	DefaultPrefetch        = 16
	DefaultDialTimeout     = 5 * time.Second
	// DefaultHeartbeat is Config.Heartbeat's default.
	DefaultHeartbeat   = 5 * time.Second
	DefaultPartitions  = 8
	DefaultConsumers   = 8
	MaxConsumers       = 256
	MaxPartitions      = 1024
	QueueTypeQuorum    = "quorum"
	QueueTypeClassic   = "classic"
	MaxNamespaceLength = 64
)

// Config configures Ferry's RabbitMQ connections and topology.
type Config struct {
	// URL is the AMQP URL, including the vhost. Default amqp://guest:guest@127.0.0.1:5672/.
	// A cluster's nodes are listed comma-separated
	// ("amqp://u:p@rmq1:5672/v,amqp://u:p@rmq2:5672/v"): every connection
	// dials the first that answers and fails over to the next when its
	// node is lost. The nodes' URLs must agree on all but the address.
	URL string
	// Namespace prefixes every exchange and queue name ("staging." say).
	// Default "" (no prefix).
	Namespace string
	// QueueType is "quorum" (replicated, the default) or "classic".
	QueueType string
	// PublishChannels is the publisher's channel pool size. Default 4.
	PublishChannels int
	// Prefetch is how many unacknowledged messages a consumer may hold. Default 16.
	Prefetch int
	// DialTimeout bounds connecting to the broker. Default 5s.
	DialTimeout time.Duration
	// Heartbeat is the AMQP heartbeat timeout the connections ask for. It
	// bounds how long a connection behind a black hole (packets dropped,
	// the connection kept open) goes unnoticed: the broker gives up a
	// silent client after about two timeouts, and hands its unacked
	// deliveries and its ordered partitions (single active consumer) to
	// the others; the client gives up a silent broker after about one and
	// a half, and reconnects. Measured on RabbitMQ 3.10 behind Toxiproxy:
	// with 10s, a consumer's partitions came back to the fleet after up to
	// 15 s; see docs/reliability.md. Default 5s; at least 1s.
	Heartbeat time.Duration
	// OrderedTopics are the topics whose events must be consumed in
	// per-aggregate order. Each is routed by a hash of the aggregate id to
	// Partitions queues per handler, each consumed by one active consumer
	// at a time. Default: none (Ferry's app fills it from the route table).
	OrderedTopics []string
	// Consumers is how many consumers (each handling one message at a time)
	// a process runs on the queue of an unordered topic's handler. Ordered
	// topics get one per partition instead. Default 8.
	Consumers int
	// Partitions is the number of partition queues of an ordered topic's
	// handler. Changing it moves aggregates between partitions: drain the
	// partition queues first (see docs/concepts.md, "Ordering"). Default 8.
	Partitions int
	// BacklogLanes gives each handler of an unordered topic a second queue,
	// its backlog lane ("<handler>@backlog", bound to "<topic>@backlog"),
	// consumed beside its queue by BacklogConsumers consumers of its own. A tenant
	// fleet (tenancy) publishes a tenant's backlog there
	// (pipeline.ContextWithBacklogLane), so that other tenants' new events
	// do not wait behind it at the broker. Ordered topics have none: their
	// order is the partition's. Default false.
	BacklogLanes bool
	// BacklogConsumers is how many consumers a process runs on a handler's
	// backlog lane: fewer than on its queue, so that a backlog drains
	// beside the new events with the rest of the machine left to them.
	// Default Consumers / 4, at least 1.
	BacklogConsumers int
}

// WithDefaults returns a copy of c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.URL == "" {
		c.URL = DefaultURL
	}
	if c.QueueType == "" {
		c.QueueType = QueueTypeQuorum
	}
	if c.PublishChannels == 0 {
		c.PublishChannels = DefaultPublishChannels
	}
	if c.Prefetch == 0 {
		c.Prefetch = DefaultPrefetch
	}
	if c.Heartbeat == 0 {
		c.Heartbeat = DefaultHeartbeat
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = DefaultDialTimeout
	}
	if c.Partitions == 0 {
		c.Partitions = DefaultPartitions
	}
	if c.Consumers == 0 {
		c.Consumers = DefaultConsumers
	}
	if c.BacklogConsumers == 0 {
		c.BacklogConsumers = max(1, c.Consumers/4)
	}
	return c
}

// Validate reports every problem of c at once.
func (c Config) Validate() error {
	var errs []error
	for _, n := range Nodes(c.URL) {
		if u, err := url.Parse(n); err != nil || (u.Scheme != "amqp" && u.Scheme != "amqps") || u.Host == "" {
			errs = append(errs, fmt.Errorf("rabbit Config.URL must be amqp:// or amqps:// URLs with a host, got %q", redact(n)))
		}
	}
	if err := ValidateNodes(c.URL); err != nil {
		errs = append(errs, fmt.Errorf("rabbit Config.URL: %w", err))
	}
	if len(c.Namespace) > MaxNamespaceLength {
		errs = append(errs, fmt.Errorf("rabbit Config.Namespace must be at most %d bytes", MaxNamespaceLength))
	}
	if strings.HasPrefix(c.Namespace, pipeline.ReservedTopicPrefix) {
		errs = append(errs, fmt.Errorf("rabbit Config.Namespace %q starts with %q, which RabbitMQ reserves for its own exchanges and queues (declaring them is refused)", c.Namespace, pipeline.ReservedTopicPrefix))
	}
	if c.QueueType != QueueTypeQuorum && c.QueueType != QueueTypeClassic {
		errs = append(errs, fmt.Errorf("rabbit Config.QueueType must be %q or %q, got %q", QueueTypeQuorum, QueueTypeClassic, c.QueueType))
	}
	if c.PublishChannels < 1 {
		errs = append(errs, errors.New("rabbit Config.PublishChannels must be at least 1"))
	}
	if c.Prefetch < 1 {
		errs = append(errs, errors.New("rabbit Config.Prefetch must be at least 1"))
	}
	if c.DialTimeout <= 0 {
		errs = append(errs, errors.New("rabbit Config.DialTimeout must be positive"))
	}
	if c.Heartbeat < time.Second {
		errs = append(errs, fmt.Errorf("rabbit Config.Heartbeat must be at least 1s, got %s", c.Heartbeat))
	}
	if c.Consumers < 1 || c.Consumers > MaxConsumers {
		errs = append(errs, fmt.Errorf("rabbit Config.Consumers must be in [1, %d], got %d", MaxConsumers, c.Consumers))
	}
	if c.BacklogConsumers < 1 || c.BacklogConsumers > MaxConsumers {
		errs = append(errs, fmt.Errorf("rabbit Config.BacklogConsumers must be in [1, %d], got %d", MaxConsumers, c.BacklogConsumers))
	}
	if c.Partitions < 1 || c.Partitions > MaxPartitions {
		errs = append(errs, fmt.Errorf("rabbit Config.Partitions must be in [1, %d], got %d", MaxPartitions, c.Partitions))
	}
	return errors.Join(errs...)
}

// redact hides the password of an AMQP URL for error messages and logs.
func redact(raw string) string { return RedactNodes(raw) }

// connectionConfig is how every Ferry connection dials: a bounded dial, a
// heartbeat, reconnection with backoff, and a name that shows in the
// broker's connection list (rabbitmqctl list_connections client_properties),
// which is how an operator tells the relay's connection from a consumer's.
func connectionConfig(cfg Config, name string) wamqp.ConnectionConfig {
	uri := cfg.URL
	if nodes := Nodes(cfg.URL); len(nodes) > 0 {
		uri = nodes[0] // the handshake's credentials and vhost; the dial picks the node
	}
	return wamqp.ConnectionConfig{
		AmqpURI: uri,
		AmqpConfig: &amqp.Config{
			Heartbeat:  cmp.Or(cfg.Heartbeat, DefaultHeartbeat),
			Locale:     "en_US",
			Dial:       newNodeDialer(cfg.URL, cfg.DialTimeout).dial,
			Properties: amqp.Table{"connection_name": name},
		},
		Reconnect: wamqp.DefaultReconnectConfig(),
	}
}

// heldDial is amqp091's dial with the socket wrapped in a heldConn.
func heldDial(timeout time.Duration) func(network, addr string) (net.Conn, error) {
	dial := amqp.DefaultDial(timeout)
	return func(network, addr string) (net.Conn, error) {
		c, err := dial(network, addr)
		if err != nil {
			return nil, err
		}
		return newHeldConn(c), nil
	}
}

// Dial opens a connection, named name, that reconnects by itself.
func Dial(cfg Config, name string, logger watermill.LoggerAdapter) (*wamqp.ConnectionWrapper, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	conn, err := wamqp.NewConnection(connectionConfig(cfg, name), logger)
	if err != nil {
		return nil, fmt.Errorf("connecting to RabbitMQ at %s: %w", redact(cfg.URL), err)
	}
	return conn, nil
}
