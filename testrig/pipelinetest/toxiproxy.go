package pipelinetest

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	toxiclient "github.com/Shopify/toxiproxy/v2/client"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
)

// Toxiproxy is Shopify's TCP fault proxy, its server run in this process
// on a loopback port and driven through its own client over its HTTP API,
// as an operator's tooling would drive it. Each proxy stands between one
// Ferry process and one server, so a fault (a black hole, latency, resets)
// strikes that process's link only; the shared servers are never touched.
type Toxiproxy struct {
	server *toxiproxy.ApiServer
	http   *http.Server
	// Client is the Toxiproxy client bound to this server.
	Client *toxiclient.Client
}

// StartToxiproxy starts a Toxiproxy server on a free loopback port.
func StartToxiproxy() (*Toxiproxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("starting Toxiproxy: %w", err)
	}
	// Some toxics log through zerolog's global logger (the bandwidth
	// toxic traces every interruption to standard error); nothing else in
	// a Ferry process uses zerolog.
	zerolog.SetGlobalLevel(zerolog.Disabled)
	server := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	t := &Toxiproxy{server: server, http: &http.Server{Handler: server.Routes(), ReadHeaderTimeout: 5 * time.Second}}
	go func() { _ = t.http.Serve(ln) }()
	t.Client = toxiclient.NewClient("http://" + ln.Addr().String())
	if _, err := t.Client.Version(); err != nil {
		_ = t.Close()
		return nil, fmt.Errorf("Toxiproxy's API does not answer: %w", err)
	}
	return t, nil
}

// Proxy creates a proxy named name to upstream (host:port) on a free
// loopback port; its Listen field is the address to dial.
func (t *Toxiproxy) Proxy(name, upstream string) (*toxiclient.Proxy, error) {
	p, err := t.Client.CreateProxy(name, "127.0.0.1:0", upstream)
	if err != nil {
		return nil, fmt.Errorf("creating the Toxiproxy proxy %s to %s: %w", name, upstream, err)
	}
	return p, nil
}

// Close stops every proxy (their connections with them) and the API.
func (t *Toxiproxy) Close() error {
	t.server.Collection.Clear()
	return t.http.Close()
}

// ThroughProxy returns rawURL (a PostgreSQL or AMQP URL naming one host)
// with its host and port replaced by listen, the proxy's address.
func ThroughProxy(rawURL, listen string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", err
	}
	if u.Host == "" || strings.Contains(u.Host, ",") {
		return "", errors.New("a URL with one host:port is needed to put a proxy in front of it")
	}
	u.Host = listen
	return u.String(), nil
}

// Upstream returns the host:port rawURL names, with the scheme's port
// when it names none.
func Upstream(rawURL string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", err
	}
	if u.Port() != "" {
		return u.Host, nil
	}
	port := map[string]string{"postgres": "5432", "postgresql": "5432", "amqp": "5672", "amqps": "5671"}[u.Scheme]
	if port == "" || u.Hostname() == "" {
		return "", fmt.Errorf("no host:port in %q", u.Redacted())
	}
	return net.JoinHostPort(u.Hostname(), port), nil
}
