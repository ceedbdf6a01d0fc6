-- Autovacuum settings that suit a queue, on the tables that churn.
--
-- Every published outbox row is rewritten once (published_at is set), every processed inbox row
-- too, and retention deletes from all three: dead rows arrive at the event rate, for good. By
-- default autovacuum waits for 50 + 20% of the table's rows to be dead. With a retention window
-- the table holds days of events, so it would wait for millions of dead rows, while the relay
-- walks past the dead entries of the unpublished index on every claim (9 minutes of 1,150
-- events/s without a vacuum grew that index to 13.5 MB and the relay's lag from 7 ms to 180 ms).
--
--   autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000:
--     vacuum once 5,000 rows are dead whatever the table's size, so at every round of the
--     autovacuum launcher (`autovacuum_naptime`, 1 minute by default: the server's setting
--     bounds how often; a busy outbox wants it lower) instead of after 20% of a table that
--     retention keeps large. Each vacuum is short: the visibility map lets it skip the pages of
--     settled rows, and PostgreSQL skips index vacuuming when few pages have dead rows.
--   autovacuum_vacuum_cost_limit = 2000:
--     ten times the default budget before each pause, so a vacuum of these tables keeps up with
--     the event rate instead of running for minutes at the default throttle. (A table with its
--     own cost settings is left out of the workers' shared budget.)
--   autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 50000:
--     statistics that follow the table's growth; the relay does not depend on them (it walks
--     the index in order), the operator's queries do.
--
-- ALTER TABLE ... SET takes a SHARE UPDATE EXCLUSIVE lock: emits, relays and consumers go on.
-- Autovacuum must be on for the server (`outbox status` warns when it is not).
ALTER TABLE outbox_event SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_limit = 2000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 50000
);
ALTER TABLE inbox_event SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_limit = 2000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 50000
);
ALTER TABLE processed_event SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_limit = 2000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 50000
);
