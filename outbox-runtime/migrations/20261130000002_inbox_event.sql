-- The inbox (rule R-DIST-OBX-2), for critical or bursty consumers: receipt is stored first,
-- then processed by a separate task.
CREATE TABLE inbox_event (
    event_id     uuid        PRIMARY KEY,
    received_at  timestamptz NOT NULL DEFAULT now(),
    payload      jsonb       NOT NULL,
    processed    boolean     NOT NULL DEFAULT false,
    processed_at timestamptz
);

CREATE INDEX ix_inbox_event_unprocessed ON inbox_event(received_at) WHERE NOT processed;
