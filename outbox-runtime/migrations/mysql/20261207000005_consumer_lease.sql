-- Which instance of a consumer group reads a JetStream topic (a durable consumer): one at a
-- time, so that a key's messages are handled in their order (JetStream hands a durable
-- consumer's messages to whichever instance pulls; it has no partitions to assign).
--
-- Two rows per group and topic, in two tables, because InnoDB's shared row lock conflicts with
-- every update of the row (PostgreSQL's `FOR KEY SHARE` lets non-key columns change):
-- - `outbox_consumer_lease` is the lease's time: the holder renews `expires_at` while it reads
--   (every third of its length), and another instance takes it over once it expired. Nothing
--   but those short updates locks it.
-- - `outbox_consumer_fence` names the holder too, and changes only when the lease changes
--   hands. Every batch transaction reads it first with a shared lock: an instance that lost
--   the lease commits nothing more, and none takes the lease over while a batch of the holder
--   runs, however long (a takeover skips a locked fence row: the lease is in use), while the
--   holder's renewals go on.
-- UTC (UTC_TIMESTAMP(6)); a released lease has no holder.
CREATE TABLE IF NOT EXISTS outbox_consumer_lease (
    group_id   VARCHAR(255) NOT NULL,
    topic      VARCHAR(255) NOT NULL,
    holder     BINARY(16)   NULL,
    expires_at DATETIME(6)  NOT NULL,
    PRIMARY KEY (group_id, topic)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE IF NOT EXISTS outbox_consumer_fence (
    group_id VARCHAR(255) NOT NULL,
    topic    VARCHAR(255) NOT NULL,
    holder   BINARY(16)   NULL,
    PRIMARY KEY (group_id, topic)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
