-- When an operator last retried a parked outbox row, and with what (`outbox parked retry`,
-- `mysql::retry_parked`): the row keeps its last error, and these say that it was retried since.
-- A run cut short leaves the columns or not, never one of them: one ALTER adds both.
SET @outbox_ddl = IF(
    EXISTS (SELECT 1 FROM information_schema.COLUMNS
            WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'outbox_event'
              AND COLUMN_NAME = 'retried_at'),
    'DO 0',
    'ALTER TABLE outbox_event
         ADD COLUMN retried_at DATETIME(6) NULL,
         ADD COLUMN retried_by VARCHAR(255) NULL');
PREPARE outbox_ddl FROM @outbox_ddl;
EXECUTE outbox_ddl;
DEALLOCATE PREPARE outbox_ddl;
