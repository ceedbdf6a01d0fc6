-- What the retention job (`outbox cleanup`) and `outbox status` need: published rows and
-- processed inbox rows by age, so that old rows are found without reading the whole table.
-- Partial: unpublished and unprocessed rows, the hot ones, are not in them.
CREATE INDEX ix_outbox_event_published_at ON outbox_event(published_at)
    WHERE published_at IS NOT NULL;
CREATE INDEX ix_inbox_event_processed_at ON inbox_event(processed_at) WHERE processed;
