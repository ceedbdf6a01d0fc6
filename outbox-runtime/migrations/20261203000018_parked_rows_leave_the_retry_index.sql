-- A parked row no longer keeps its retry time: every relay batch begins by reading the rows of
-- its shards that wait for a retry, through `ix_outbox_event_retrying` (published_at IS NULL
-- AND next_attempt_at IS NOT NULL), and parked rows, which can pile up for months, made that
-- read grow with them. The relay now clears `next_attempt_at` when it parks a row (a retry of
-- a parked row sets it again: due now); this takes the rows parked before out of the index.
-- Parked rows are few, and found through `ix_outbox_event_parked`.
UPDATE outbox_event SET next_attempt_at = NULL
WHERE parked_at IS NOT NULL AND next_attempt_at IS NOT NULL;
