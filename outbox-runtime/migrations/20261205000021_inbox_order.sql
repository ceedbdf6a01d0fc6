-- Per-key order in inbox mode: each row gets `seq`, its place in the order the consumers
-- received it, and processors handle a partition key's rows in that order (see
-- `store/inbox/claim.rs`): a row is claimed only with every earlier unprocessed, live row of
-- its key, under a transaction-scoped advisory lock on the key, so two processors (in one
-- process or several) never work on one key at once, and a row waiting for its retry holds
-- back the later rows of its key alone.
--
-- A key's rows are received in the broker's order by one transaction at a time (the receipt's
-- advisory lock per source topic and partition; a key is in one partition, shard or stream),
-- so `seq`, taken at insert, orders them as the broker did.
--
-- The sequence is not owned by the column: converting the table to partitions
-- (`outbox partitions convert --table inbox`) renames the old table and makes a new one, LIKE
-- it, with this default.
CREATE SEQUENCE inbox_event_seq;

-- No default at first, so adding the column rewrites nothing; new rows get the default.
ALTER TABLE inbox_event ADD COLUMN seq bigint;
ALTER TABLE inbox_event ALTER COLUMN seq SET DEFAULT nextval('inbox_event_seq');

-- Rows still to process, or dead (an operator may retry them), numbered in the order they
-- were received. Processed rows keep NULL: nothing orders by them again.
UPDATE inbox_event i SET seq = o.seq
FROM (SELECT event_id, received_at, nextval('inbox_event_seq') AS seq
      FROM (SELECT event_id, received_at FROM inbox_event WHERE NOT processed
            ORDER BY received_at, source_partition, source_offset) ordered) o
WHERE i.event_id = o.event_id AND i.received_at = o.received_at;

-- The processors' window, oldest first; each key's rows from its head, for the claim.
CREATE INDEX ix_inbox_event_pending ON inbox_event (seq) WHERE NOT processed AND dead_at IS NULL;
CREATE INDEX ix_inbox_event_key_pending ON inbox_event (topic, partition_key, seq)
    WHERE NOT processed AND dead_at IS NULL;
-- Rows waiting for a retry, by key: what holds a key's later rows back. Failed rows alone, so
-- the window's look at each row's key costs a probe into a small index, however long the
-- key's backlog.
CREATE INDEX ix_inbox_event_key_retrying ON inbox_event (topic, partition_key, seq)
    WHERE next_attempt_at IS NOT NULL AND NOT processed AND dead_at IS NULL;
