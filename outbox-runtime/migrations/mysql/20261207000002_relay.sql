-- What the relay needs of outbox_event on MariaDB and MySQL: when a record was first held for an
-- operator (its topic missing, the relay not allowed to write), and the claim's index. MySQL has
-- no ADD COLUMN IF NOT EXISTS, so the ALTER runs only where the column is missing; one ALTER
-- statement is atomic in InnoDB, so a run cut short leaves all of it or none.
--
-- The claim reads unpublished, unparked rows in id order: (published_at, parked_at, id) gives
-- it that order with both NULLs as an equality prefix (no sort, whatever the backlog). The
-- retry index finds the few rows waiting for their next attempt, which hold back their key.
SET @outbox_ddl = IF(
    EXISTS (SELECT 1 FROM information_schema.COLUMNS
            WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'outbox_event'
              AND COLUMN_NAME = 'held_at'),
    'DO 0',
    'ALTER TABLE outbox_event
         ADD COLUMN held_at DATETIME(6) NULL AFTER next_attempt_at,
         ADD KEY ix_outbox_event_claim (published_at, parked_at, id),
         ADD KEY ix_outbox_event_retry (next_attempt_at),
         DROP KEY ix_outbox_event_unpublished');
PREPARE outbox_ddl FROM @outbox_ddl;
EXECUTE outbox_ddl;
DEALLOCATE PREPARE outbox_ddl;
