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

-- Wake relays as soon as events commit: NOTIFY is delivered at commit, once per transaction
-- (identical notifications collapse). Relays treat it only as a hint and always re-query.
CREATE FUNCTION outbox_event_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_event', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_event_notify AFTER INSERT ON outbox_event
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_event_notify();
