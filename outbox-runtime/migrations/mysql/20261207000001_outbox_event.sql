-- The outbox on MariaDB 10.6+ and MySQL 8.0.1+ (InnoDB): one row per event, written in the
-- command's transaction. DDL commits on its own there, so every statement of a migration can run
-- again after one cut short (IF NOT EXISTS, inserts that skip what is there).
CREATE TABLE IF NOT EXISTS outbox_event (
    id              BIGINT            NOT NULL AUTO_INCREMENT,
    event_id        BINARY(16)        NOT NULL,
    aggregate_type  VARCHAR(255)      NOT NULL,
    aggregate_id    TEXT              NOT NULL,
    event_type      VARCHAR(255)      NOT NULL,
    -- MySQL's JSON is binary and validated; MariaDB's is LONGTEXT with a JSON_VALID check.
    payload         JSON              NOT NULL,
    -- The application's headers, a JSON object; NULL when it gave none.
    headers         JSON              NULL,
    topic           VARCHAR(255)      NOT NULL,
    partition_key   TEXT              NOT NULL,
    -- CRC32 of the partition key's UTF-8 bytes, low 16 bits: the row of outbox_key_lock that
    -- its emitter locked, and what the relay's shards are made of.
    key_bucket      SMALLINT UNSIGNED NOT NULL,
    -- UTC, written by the emitter (UTC_TIMESTAMP(6)).
    created_at      DATETIME(6)       NOT NULL,
    published_at    DATETIME(6)       NULL,
    attempts        INT               NOT NULL DEFAULT 0,
    last_error      TEXT              NULL,
    next_attempt_at DATETIME(6)       NULL,
    parked_at       DATETIME(6)       NULL,
    PRIMARY KEY (id),
    UNIQUE KEY ux_outbox_event_event_id (event_id),
    KEY ix_outbox_event_unpublished (published_at, id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- One row per hash bucket of a partition key, all created here and never inserted into again:
-- an emitter locks its keys' buckets (SELECT ... FOR UPDATE) before it inserts their rows, so a
-- key's next transaction takes its AUTO_INCREMENT id only after the one before it committed. As
-- every row exists, the gap locks of REPEATABLE READ block no insert; one statement takes its
-- rows in index order, so two emitters never deadlock on them.
CREATE TABLE IF NOT EXISTS outbox_key_lock (
    bucket SMALLINT UNSIGNED NOT NULL,
    PRIMARY KEY (bucket)
) ENGINE = InnoDB;

-- The 65,536 buckets: 16 values of each hexadecimal digit, crossed (a recursive CTE would meet
-- MySQL's cte_max_recursion_depth of 1,000). Wrapped in a derived table, so that ON DUPLICATE
-- KEY is not read as the last join's ON.
INSERT INTO outbox_key_lock (bucket)
SELECT buckets.bucket FROM (
    SELECT a.n * 4096 + b.n * 256 + c.n * 16 + d.n AS bucket
    FROM (SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
          UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8
          UNION ALL SELECT 9 UNION ALL SELECT 10 UNION ALL SELECT 11 UNION ALL SELECT 12
          UNION ALL SELECT 13 UNION ALL SELECT 14 UNION ALL SELECT 15) AS a
    CROSS JOIN (SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
          UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8
          UNION ALL SELECT 9 UNION ALL SELECT 10 UNION ALL SELECT 11 UNION ALL SELECT 12
          UNION ALL SELECT 13 UNION ALL SELECT 14 UNION ALL SELECT 15) AS b
    CROSS JOIN (SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
          UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8
          UNION ALL SELECT 9 UNION ALL SELECT 10 UNION ALL SELECT 11 UNION ALL SELECT 12
          UNION ALL SELECT 13 UNION ALL SELECT 14 UNION ALL SELECT 15) AS c
    CROSS JOIN (SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
          UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8
          UNION ALL SELECT 9 UNION ALL SELECT 10 UNION ALL SELECT 11 UNION ALL SELECT 12
          UNION ALL SELECT 13 UNION ALL SELECT 14 UNION ALL SELECT 15) AS d
) AS buckets
ON DUPLICATE KEY UPDATE bucket = outbox_key_lock.bucket;
