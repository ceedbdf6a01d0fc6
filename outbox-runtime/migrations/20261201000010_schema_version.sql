-- The schema version of an inbox row's event (`#[outbox(version = N)]`, sent in the
-- `outbox_schema_version` header; 1 without it): its handlers see it in their metadata, and
-- one that does not accept it dead-letters the row unless an upcaster is registered. A
-- constant default rewrites nothing.
ALTER TABLE inbox_event ADD COLUMN schema_version bigint NOT NULL DEFAULT 1;
