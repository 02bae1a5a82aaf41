package rabbit_test

import (
	"context"
	"errors"
	neturl "net/url"
	"os/exec"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/ferry-dev/ferry/pipeline/rabbit"
	"github.com/ferry-dev/ferry/testrig/pipelinetest"
)

// The broker permissions docs/operations.md shows hold: the consumers' user
// declares and binds its queues, but cannot publish to Ferry's exchanges;
// the relay's user can.
func TestReadmeBrokerPermissions(t *testing.T) {
	t.Parallel()
	pipelinetest.Rabbit(t) // fails clearly when the broker is not there
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		t.Fatalf("this test needs rabbitmqctl on PATH: %v", err)
	}
	ctl := func(args ...string) {
		t.Helper()
		out, err := exec.Command("rabbitmqctl", append([]string{"-q"}, args...)...).CombinedOutput()
		require.NoError(t, err, "rabbitmqctl %v: %s", args, out)
	}
	vhost := pipelinetest.UniqueName("ferrytest-perm-")
	relay, consumer := vhost+"-relay", vhost+"-consumer"
	ctl("add_vhost", vhost)
	t.Cleanup(func() {
		for _, args := range [][]string{{"delete_vhost", vhost}, {"delete_user", relay}, {"delete_user", consumer}} {
			_ = exec.Command("rabbitmqctl", append([]string{"-q"}, args...)...).Run()
		}
	})
	ctl("add_user", relay, "relay-pw")
	ctl("add_user", consumer, "consumer-pw")
	// As in docs/operations.md, section "Broker permissions".
	ctl("set_permissions", "-p", vhost, relay, ".*", ".*", ".*")
	ctl("set_permissions", "-p", vhost, consumer, ".*", `^(payments\.charge(@[0-9]+)?|notifications\.mail|ferry\.unrouted)$`, ".*")

	url := func(user, pw string) string {
		u, err := neturl.Parse(pipelinetest.AMQPURL())
		require.NoError(t, err)
		u.User, u.Path = neturl.UserPassword(user, pw), "/"+vhost
		return u.String()
	}
	bindings := []rabbit.Binding{{Topic: "stripe.charge", Queue: "payments.charge"}, {Topic: "mail.send", Queue: "notifications.mail"}}
	cfgFor := func(u string) rabbit.Config {
		return rabbit.Config{URL: u, OrderedTopics: []string{"stripe.charge"}}.WithDefaults()
	}

	// The consumers' user builds the whole topology of its routes.
	ccfg := cfgFor(url(consumer, "consumer-pw"))
	topo, err := rabbit.NewTopology(ccfg)
	require.NoError(t, err)
	cconn, err := amqp.Dial(ccfg.URL)
	require.NoError(t, err)
	defer cconn.Close()
	require.NoError(t, topo.Declare(cconn, bindings...), "the consumers' user declares and binds its queues")

	publish := func(conn *amqp.Connection, exchange string) error {
		ch, err := conn.Channel()
		require.NoError(t, err)
		defer ch.Close()
		closed := ch.NotifyClose(make(chan *amqp.Error, 1))
		require.NoError(t, ch.Confirm(false))
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		conf, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, "", false, false, amqp.Publishing{Body: []byte("{}")})
		if err == nil {
			select {
			case cerr := <-closed: // the broker closes the channel on a refused publish
				if cerr != nil {
					return cerr
				}
				return amqp.ErrClosed
			case <-conf.Done():
				if !conf.Acked() {
					// A refused publish closes the channel, and the client
					// settles its pending confirms as nacks as it does: the
					// two arrive together, in either order. The close says
					// why.
					select {
					case cerr := <-closed:
						if cerr != nil {
							return cerr
						}
					case <-time.After(2 * time.Second):
					}
					return errors.New("nacked")
				}
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return err
	}
	for _, topic := range []string{"mail.send", "stripe.charge", "ferry.retry"} {
		err := publish(cconn, topo.ExchangeName(topic))
		require.Error(t, err, "the consumers' user must not publish to %s", topic)
		require.Contains(t, err.Error(), "ACCESS_REFUSED")
	}

	rconn, err := amqp.Dial(url(relay, "relay-pw"))
	require.NoError(t, err)
	defer rconn.Close()
	require.NoError(t, publish(rconn, topo.ExchangeName("mail.send")), "the relay's user publishes")
}
