-- +goose Up
-- The route table as the consumers last ran it: the topic each route
-- consumes, and over how many partition queues when it is ordered. The
-- tools that run without the route table (ferry find and status from the
-- stock binary, another service's console) read it to say which pause or
-- held partition a message at the broker waits behind.
CREATE TABLE ferry_routes (
    route      text        PRIMARY KEY,
    topic      text        NOT NULL,
    ordered    boolean     NOT NULL,
    partitions integer     NOT NULL CHECK (partitions >= 1),
    seen_at    timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE ferry_routes;
