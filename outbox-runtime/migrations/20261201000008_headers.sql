-- Headers stored with each event: sent as Kafka headers after the framework's own (a tenant,
-- a correlation id, trace context), and kept by replays; what a consumer received, on inbox
-- rows. Existing rows get '{}'. A column with a constant default rewrites nothing.
ALTER TABLE outbox_event ADD COLUMN headers jsonb NOT NULL DEFAULT '{}';
ALTER TABLE inbox_event ADD COLUMN headers jsonb NOT NULL DEFAULT '{}';

-- `outbox_emit` with each row's headers (a JSON object as text). The 7-argument form stays:
-- emits without headers call it (their cost does not change), and so do binaries of the
-- previous version during a rolling deploy.
CREATE OR REPLACE FUNCTION outbox_emit(
    event_ids uuid[], aggregate_types text[], aggregate_ids text[], event_types text[],
    payloads text[], topics text[], partition_keys text[], headers text[]
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_current_xact_id();
    IF cardinality(event_ids) = 1 THEN
        PERFORM pg_advisory_xact_lock(1868724325, hashtext(partition_keys[1]));
        INSERT INTO outbox_event
            (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key,
             headers)
        VALUES (event_ids[1], aggregate_types[1], aggregate_ids[1], event_types[1],
                payloads[1]::jsonb, topics[1], partition_keys[1], headers[1]::jsonb);
    ELSE
        PERFORM pg_advisory_xact_lock(1868724325, h)
        FROM (SELECT DISTINCT hashtext(k) AS h FROM unnest(partition_keys) AS k ORDER BY 1) AS sorted;
        INSERT INTO outbox_event
            (event_id, aggregate_type, aggregate_id, event_type, payload, topic, partition_key,
             headers)
        SELECT r.event_id, r.aggregate_type, r.aggregate_id, r.event_type, r.payload::jsonb,
               r.topic, r.partition_key, r.headers::jsonb
        FROM unnest(event_ids, aggregate_types, aggregate_ids, event_types, payloads, topics,
                    partition_keys, headers)
            WITH ORDINALITY AS r(event_id, aggregate_type, aggregate_id, event_type, payload,
                                 topic, partition_key, headers, n)
        ORDER BY r.n;
    END IF;
    IF EXISTS (SELECT 1 FROM outbox_relay_waiting) THEN
        PERFORM pg_notify('outbox_event', '');
    END IF;
END
$$;
