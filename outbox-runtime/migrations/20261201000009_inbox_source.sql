-- Where an inbox row's message was read: its handlers see it in their metadata
-- (`MessageMeta::partition`, `MessageMeta::offset`). NULL for rows stored before this
-- migration. Adding nullable columns rewrites nothing.
ALTER TABLE inbox_event
    ADD COLUMN source_partition integer,
    ADD COLUMN source_offset    bigint;
