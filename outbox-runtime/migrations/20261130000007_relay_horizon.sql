-- What the relay needs for faults and stale statistics.

-- Rows held back by an operator's problem (unknown topic, not authorized): since when. They
-- keep their key waiting, are retried, and are never parked for it; `outbox status` shows them.
ALTER TABLE outbox_event ADD COLUMN held_at timestamptz;

-- `outbox_emit` now makes sure the transaction has its transaction id before the rows draw
-- their ids: the relay's claim relies on "an id drawn before I read the sequence belongs to a
-- transaction that had started before my snapshot" to never step past a row that is still
-- to commit (see ARCHITECTURE.md, the claim's horizon). Otherwise as before.
CREATE OR REPLACE FUNCTION outbox_emit(
    event_ids uuid[], aggregate_types text[], aggregate_ids text[], event_types text[],
    payloads text[], topics text[], partition_keys text[]
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_current_xact_id();
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
