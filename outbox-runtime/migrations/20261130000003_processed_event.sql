-- Consumer-side deduplication (the default for ordinary consumers): one row per event id and
-- handler, inserted with ON CONFLICT DO NOTHING in the handler's own transaction.
CREATE TABLE processed_event (
    event_id     uuid        NOT NULL,
    handler      text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, handler)
);

-- For the retention job, which deletes old rows by age.
CREATE INDEX ix_processed_event_processed_at ON processed_event(processed_at);
