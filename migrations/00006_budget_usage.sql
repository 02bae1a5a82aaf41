-- +goose Up
-- Spend of the budget breaker (middleware.Budget): one row per budget and
-- window, shared by every consumer process, so the budget holds across a
-- fleet and across restarts.
CREATE TABLE budget_usage (
    budget       text        NOT NULL,
    window_start timestamptz NOT NULL,
    used         bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (budget, window_start)
);

-- +goose Down
DROP TABLE budget_usage;
