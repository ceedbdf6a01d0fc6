-- Which instance of a consumer group reads a JetStream topic (a durable consumer) in dedup mode:
-- one at a time, so that a key's messages are handled in their order (JetStream hands a durable
-- consumer's messages to whichever instance pulls; it has no partitions to assign). The holder
-- renews its lease while it reads, and every batch transaction checks it (`FOR KEY SHARE`), so an
-- instance that lost it (stalled past `expires_at`, cut off) commits nothing more; another takes
-- it over once it expired. A released lease has no holder.
CREATE TABLE outbox_consumer_lease (
    group_id   text        NOT NULL,
    topic      text        NOT NULL,
    holder     uuid,
    expires_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, topic)
);
