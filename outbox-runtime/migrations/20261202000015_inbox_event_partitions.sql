-- `inbox_event` in time partitions (by `received_at`), as `processed_event` is since
-- `..._013_processed_event_partitions`: retention drops a whole partition once every row in it
-- is processed and it ended before the dedup window, instead of deleting rows (and never drops
-- one that holds an unprocessed or dead row: it is kept and reported, see
-- `outbox_partition_kept`).
--
-- The key is (event_id, received_at): a partitioned table's unique key must contain its
-- partition key. Uniqueness per event_id holds across partitions by how consumers insert (see
-- `inbox/store.rs`): a transaction-scoped advisory lock per source topic and partition first,
-- then an insert of the events no partition holds yet, at READ COMMITTED; the same message in
-- two consumers at once (one the group replaced, still finishing its batch) takes the same
-- lock, so the second sees the first's row once it commits.
--
-- Opt-in in this version, for new installations too: the table stays as it is, and works as
-- before, until converted (`outbox partitions convert --table inbox`, once no consumer of an
-- older version runs: those insert with ON CONFLICT (event_id), which the partitioned table
-- refuses). This migration adds what the conversion and the partitions need.

-- Storage options for each new partition (`ALTER TABLE ... SET (...)`): a partitioned table
-- has none of its own, its partitions do.
ALTER TABLE outbox_partitioning ADD COLUMN partition_options text;

-- Inbox rows are updated once each (processed, or failed and retried): the queue settings of
-- `..._011_queue_autovacuum`, which says why, on each partition.
INSERT INTO outbox_partitioning (parent, width, ahead, partition_options)
VALUES ('inbox_event', interval '1 day', interval '3 days',
        'autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000, '
        'autovacuum_vacuum_cost_limit = 2000, autovacuum_analyze_scale_factor = 0, '
        'autovacuum_analyze_threshold = 50000');

-- Partitions retention found past its window but kept, and why (an unprocessed or a dead row
-- in it); `outbox status` reports them. Retention writes it at each run.
CREATE TABLE outbox_partition_kept (
    partition text        PRIMARY KEY,
    parent    text        NOT NULL,
    reason    text        NOT NULL,
    since     timestamptz NOT NULL DEFAULT now()
);

-- `outbox_create_partitions` again: each new partition gets its table's `partition_options`.
-- The rest is as in `..._014_create_partitions_beside_another`, whose comments and those of
-- `..._013_processed_event_partitions` say why.
CREATE OR REPLACE FUNCTION outbox_create_partitions(parent regclass, since timestamptz DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    settings  outbox_partitioning%ROWTYPE;
    schema    text;
    base      text;
    keycol    text;
    start_at  timestamptz;
    name      text;
    created   integer := 0;
    timeout   text := current_setting('lock_timeout');
BEGIN
    SELECT n.nspname, c.relname INTO schema, base
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE c.oid = parent AND c.relkind = 'p';
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    SELECT * INTO settings FROM outbox_partitioning p WHERE p.parent = base;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox_partitioning has no row for %', base;
    END IF;
    keycol := substring(pg_get_partkeydef(parent) FROM '^RANGE \((\w+)\)$');
    PERFORM pg_advisory_xact_lock(parent::oid::int4, 1346458196); -- "PART"
    PERFORM set_config('lock_timeout', '5s', true);
    SELECT max(upper_bound) INTO start_at FROM outbox_partitions(parent);
    IF start_at IS NULL THEN
        start_at := date_bin(settings.width, coalesce(since, now()),
                             timestamptz '2000-01-01 00:00:00+00');
        name := base || '_history';
        IF to_regclass(format('%I.%I', schema, name)) IS NULL THEN
            EXECUTE format('CREATE TABLE %I.%I (LIKE %s INCLUDING DEFAULTS INCLUDING INDEXES)',
                           schema, name, parent);
            IF settings.partition_options IS NOT NULL THEN
                EXECUTE format('ALTER TABLE %I.%I SET (%s)', schema, name,
                               settings.partition_options);
            END IF;
            EXECUTE format('ALTER TABLE %s ATTACH PARTITION %I.%I FOR VALUES FROM (MINVALUE) TO (%L)',
                           parent, schema, name, start_at);
            created := created + 1;
        END IF;
    END IF;
    WHILE start_at < now() + settings.ahead LOOP
        name := base || '_' || to_char(start_at AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MI');
        IF to_regclass(format('%I.%I', schema, name)) IS NULL THEN
            EXECUTE format('CREATE TABLE %I.%I (LIKE %s INCLUDING DEFAULTS INCLUDING INDEXES)',
                           schema, name, parent);
            IF settings.partition_options IS NOT NULL THEN
                EXECUTE format('ALTER TABLE %I.%I SET (%s)', schema, name,
                               settings.partition_options);
            END IF;
            EXECUTE format('ALTER TABLE %I.%I ADD CONSTRAINT %I CHECK (%I >= %L AND %I < %L)',
                           schema, name, name || '_bounds', keycol, start_at, keycol,
                           start_at + settings.width);
            EXECUTE format('ALTER TABLE %s ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
                           parent, schema, name, start_at, start_at + settings.width);
            created := created + 1;
        END IF;
        start_at := start_at + settings.width;
    END LOOP;
    PERFORM set_config('lock_timeout', timeout, true);
    RETURN created;
END
$$;
