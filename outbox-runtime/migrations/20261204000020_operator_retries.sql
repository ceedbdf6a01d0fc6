-- What an operator's retry leaves on a parked outbox row or a dead inbox row: when, and by
-- which action (the console's Retry, `outbox parked retry`, `outbox inbox dead retry`, or a
-- program's call of `admin::retry_parked_by` / `retry_dead_by`). A retry starts the row's
-- attempts again from zero and keeps its last error: with these, the row can say it was
-- retried, and its last error reads as what happened before the retry (until an attempt
-- after it fails).
--
-- Columns without a default: adding them rewrites nothing (on a partitioned table, every
-- partition gets them, and the partitions created later too, made LIKE their table).
ALTER TABLE outbox_event ADD COLUMN retried_at timestamptz, ADD COLUMN retried_by text;
ALTER TABLE inbox_event ADD COLUMN retried_at timestamptz, ADD COLUMN retried_by text;
