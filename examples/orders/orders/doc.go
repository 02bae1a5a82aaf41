// Package orders is Ferry's example domain: the create_order tool, which a
// service or an AI agent calls to place an order.
//
// It shows the one rule of an outbox: the domain never calls the payment
// provider or the mail server. It writes the order and publishes the
// stripe.charge and mail.send events in the same transaction, through the
// outbox; consumer handlers make the calls after the commit.
package orders
