-- What the relay needs beside the reference columns.

-- Failures of a record the broker rejects (too large, invalid topic, ...): attempts so far, the
-- last error, when to try again; `parked_at` once it gave up (kept for operators, skipped by the
-- relay's hot path).
ALTER TABLE outbox_event
    ADD COLUMN attempts        integer     NOT NULL DEFAULT 0,
    ADD COLUMN last_error      text,
    ADD COLUMN next_attempt_at timestamptz,
    ADD COLUMN parked_at       timestamptz;

-- Keys with a record waiting to be retried: later records of such a key wait too (per-key
-- order). Tiny: only failed, unpublished rows are in it.
CREATE INDEX ix_outbox_event_retrying ON outbox_event(partition_key)
    WHERE published_at IS NULL AND next_attempt_at IS NOT NULL;

-- Parked records, for operators.
CREATE INDEX ix_outbox_event_parked ON outbox_event(id) WHERE parked_at IS NOT NULL;

-- Relay instances waiting for work, by member slot. While any waits, emitters send NOTIFY so it
-- wakes at once; while all are busy they send none, because NOTIFY serializes committing
-- transactions (PostgreSQL takes a database-wide lock for it at commit).
CREATE TABLE outbox_relay_waiting (
    slot  integer     PRIMARY KEY,
    since timestamptz NOT NULL DEFAULT now()
);

-- What `emit` calls, in the emitting transaction: takes the per-key advisory locks (in hash
-- order, so emitters never deadlock) that make one key's rows commit in id order, inserts the
-- rows in the order given, and notifies waiting relays. A function, so that its plans are
-- cached per connection even when called from a simple query.
CREATE FUNCTION outbox_emit(
    event_ids uuid[], aggregate_types text[], aggregate_ids text[], event_types text[],
    payloads text[], topics text[], partition_keys text[]
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF cardinality(event_ids) = 1 THEN
        PERFORM pg_advisory_xact_lock(1868724325, hashtext(partition_keys[1]));
        INSERT INTO outbox_event
            (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key)
        VALUES (event_ids[1], aggregate_types[1], aggregate_ids[1], event_types[1],
                payloads[1]::jsonb, topics[1], partition_keys[1]);
    ELSE
        PERFORM pg_advisory_xact_lock(1868724325, h)
        FROM (SELECT DISTINCT hashtext(k) AS h FROM unnest(partition_keys) AS k ORDER BY 1) AS sorted;
        INSERT INTO outbox_event
            (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key)
        SELECT r.event_id, r.aggregate_type, r.aggregate_id, r.event_type, r.payload::jsonb,
               r.topic, r.partition_key
        FROM unnest(event_ids, aggregate_types, aggregate_ids, event_types, payloads, topics,
                    partition_keys)
            WITH ORDINALITY AS r(event_id, aggregate_type, aggregate_id, event_type, payload,
                                 topic, partition_key, n)
        ORDER BY r.n;
    END IF;
    IF EXISTS (SELECT 1 FROM outbox_relay_waiting) THEN
        PERFORM pg_notify('outbox_event', '');
    END IF;
END
$$;
