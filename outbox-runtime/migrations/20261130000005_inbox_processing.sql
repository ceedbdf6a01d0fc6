-- What the inbox processor needs beside the reference columns: where the message came from
-- (to route it to handlers), and its failures: attempts so far, the last error, when to try
-- again, and `dead_at` once it gave up (kept for operators, skipped by processors).
ALTER TABLE inbox_event
    ADD COLUMN topic           text        NOT NULL DEFAULT '',
    ADD COLUMN event_type      text        NOT NULL DEFAULT '',
    ADD COLUMN partition_key   text,
    ADD COLUMN attempts        integer     NOT NULL DEFAULT 0,
    ADD COLUMN last_error      text,
    ADD COLUMN next_attempt_at timestamptz,
    ADD COLUMN dead_at         timestamptz;

-- Dead rows, for operators.
CREATE INDEX ix_inbox_event_dead ON inbox_event(received_at) WHERE dead_at IS NOT NULL;
