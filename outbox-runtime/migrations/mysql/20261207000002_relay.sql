-- What the relay needs of outbox_event on MariaDB and MySQL: when a record was first held for an
-- operator (its topic missing, the relay not allowed to write), and the claim's index. MySQL has
-- no ADD COLUMN IF NOT EXISTS, so the ALTER runs only where the column is missing; one ALTER
-- statement is atomic in InnoDB, so a run cut short leaves all of it or none.
--
-- The claim reads unpublished, unparked rows in id order: (published_at, parked_at, id) gives
-- it that order with both NULLs as an equality prefix (no sort, whatever the backlog), and
-- key_bucket after it lets a relay pass other relays' shards in the index alone.
--
-- A row waiting for its next attempt holds back the rows of its key behind it, so the claim
-- asks, for each row, whether one of its key waits. No partial indexes here: waiting_bucket is
-- the key's bucket while the row waits and NULL otherwise, so its index holds the waiting rows
-- alone and the question is one dive into a few entries, whatever the backlog.
SET @outbox_ddl = IF(
    EXISTS (SELECT 1 FROM information_schema.COLUMNS
            WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'outbox_event'
              AND COLUMN_NAME = 'held_at'),
    'DO 0',
    'ALTER TABLE outbox_event
         ADD COLUMN held_at DATETIME(6) NULL AFTER next_attempt_at,
         ADD KEY ix_outbox_event_claim (published_at, parked_at, id, key_bucket),
         ADD COLUMN waiting_bucket SMALLINT UNSIGNED AS (CASE WHEN next_attempt_at IS NOT NULL
             AND parked_at IS NULL AND published_at IS NULL THEN key_bucket END) STORED,
         ADD KEY ix_outbox_event_waiting (waiting_bucket, id),
         DROP KEY ix_outbox_event_unpublished');
PREPARE outbox_ddl FROM @outbox_ddl;
EXECUTE outbox_ddl;
DEALLOCATE PREPARE outbox_ddl;
