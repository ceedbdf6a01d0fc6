-- Retry and dead-letter topics a consumer found missing when it started (or since): each
-- consumer group records its own, and clears them once they exist. `outbox status` warns about
-- every row (a consumer pauses every partition at its first send to a missing topic), and
-- `outbox topics ensure` clears the rows of the topics it creates.
CREATE TABLE outbox_consumer_missing_topic (
    group_id     text        NOT NULL,
    topic        text        NOT NULL,
    source_topic text        NOT NULL,
    role         text        NOT NULL CHECK (role IN ('retry', 'dead_letter')),
    seen_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, topic)
);
