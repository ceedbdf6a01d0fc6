-- Consumers on MariaDB/MySQL, dedup mode: one row per event id and handler key, inserted in the
-- handler's own transaction. Not partitioned: its primary key makes a pair's second insert wait
-- for the first transaction and then fail as a duplicate, which is what keeps an effect once.
CREATE TABLE IF NOT EXISTS processed_event (
    event_id     BINARY(16)   NOT NULL,
    handler      VARCHAR(255) NOT NULL,
    -- UTC, written by the consumer (UTC_TIMESTAMP(6)).
    processed_at DATETIME(6)  NOT NULL,
    PRIMARY KEY (event_id, handler),
    -- For retention, which deletes old rows by age.
    KEY ix_processed_event_processed_at (processed_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Retry and dead-letter topics a consumer found missing when it started (or since), as on
-- PostgreSQL: each consumer group records its own, and clears them once they exist.
CREATE TABLE IF NOT EXISTS outbox_consumer_missing_topic (
    group_id     VARCHAR(255) NOT NULL,
    topic        VARCHAR(255) NOT NULL,
    source_topic VARCHAR(255) NOT NULL,
    role         VARCHAR(16)  NOT NULL,
    seen_at      DATETIME(6)  NOT NULL,
    PRIMARY KEY (group_id, topic),
    CONSTRAINT ck_outbox_consumer_missing_topic_role CHECK (role IN ('retry', 'dead_letter'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
