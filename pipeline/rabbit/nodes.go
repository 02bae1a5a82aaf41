package rabbit

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferry-dev/ferry/pipeline"
)

// A cluster's nodes are listed in one URL setting, comma-separated, and
// every connection (Watermill's, which reconnects by itself, and Ferry's
// own) dials through nodeDialer: amqp091 and Watermill take one URL, and
// hand the dial function only its address, so the failover lives there.
// The URLs must agree on everything but the address (user, password,
// vhost, TLS): the connection's handshake uses the first URL's.

// Nodes splits a URL setting into its nodes' URLs ("amqp://h1/,amqp://h2/").
func Nodes(raw string) []string { return pipeline.SplitList(raw) }

// RedactNodes is pipeline.RedactURL for every node of a URL setting.
func RedactNodes(raw string) string {
	nodes := Nodes(raw)
	for i, n := range nodes {
		nodes[i] = pipeline.RedactURL(n)
	}
	return strings.Join(nodes, ",")
}

// ValidateNodes checks every node's URL, and that they differ only in
// their address.
func ValidateNodes(raw string) error {
	nodes := Nodes(raw)
	if len(nodes) == 0 {
		return errors.New("no URL")
	}
	var first amqp.URI
	for i, n := range nodes {
		u, err := amqp.ParseURI(n)
		if err != nil {
			return fmt.Errorf("node %d (%s): %w", i+1, pipeline.RedactURL(n), err)
		}
		if i == 0 {
			first = u
			continue
		}
		if u.Scheme != first.Scheme || u.Username != first.Username || u.Password != first.Password || u.Vhost != first.Vhost {
			return fmt.Errorf("node %d (%s) differs from the first in scheme, user, password or vhost: the nodes of one cluster share them", i+1, pipeline.RedactURL(n))
		}
	}
	return nil
}

// nodeDialer dials the first node that answers, starting from the one
// that answered last, so a reconnection after a node's loss lands on a
// live node and a healthy connection is not moved.
type nodeDialer struct {
	addrs   []string
	timeout time.Duration
	mu      sync.Mutex
	next    int
}

func newNodeDialer(raw string, timeout time.Duration) *nodeDialer {
	d := &nodeDialer{timeout: timeout}
	for _, n := range Nodes(raw) {
		u, err := amqp.ParseURI(n)
		if err != nil {
			continue // Validate names it
		}
		d.addrs = append(d.addrs, net.JoinHostPort(u.Host, fmt.Sprint(u.Port)))
	}
	return d
}

// dial is an amqp.Config.Dial: addr (the first URL's) is replaced by the
// nodes in turn.
func (d *nodeDialer) dial(network, addr string) (net.Conn, error) {
	if len(d.addrs) <= 1 {
		return heldDial(d.timeout)(network, addr)
	}
	d.mu.Lock()
	start := d.next
	d.mu.Unlock()
	var errs []error
	for i := range d.addrs {
		k := (start + i) % len(d.addrs)
		c, err := heldDial(d.timeout)(network, d.addrs[k])
		if err == nil {
			d.mu.Lock()
			d.next = k
			d.mu.Unlock()
			return c, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", d.addrs[k], err))
	}
	return nil, fmt.Errorf("no RabbitMQ node answered: %w", errors.Join(errs...))
}

// AMQPConfig is the amqp091 configuration and URI Ferry's connections use
// for cfg (its nodes, its dial timeout), for a connection of the caller's
// own (amqp.DialConfig(uri, conf)).
func AMQPConfig(cfg Config, name string) (uri string, conf amqp.Config) {
	cfg = cfg.WithDefaults()
	c := connectionConfig(cfg, name)
	return c.AmqpURI, *c.AmqpConfig
}
