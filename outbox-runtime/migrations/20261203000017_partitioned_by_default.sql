-- A new installation gets `outbox_event` and `inbox_event` in time partitions, as it gets
-- `processed_event` since `..._013_processed_event_partitions`: retention then drops whole
-- partitions instead of deleting rows, and the tables stay flat over months whatever
-- autovacuum does (docs/operations.md). The layout is the one `outbox partitions convert`
-- gives an existing installation (`..._015_inbox_event_partitions` and
-- `..._016_outbox_event_partitions` say why each key is what it is); a test checks that both
-- ways end in the same tables.
--
-- New means: no row in any of the three tables, none ever written as far as the server knows
-- (the outbox's id sequence never drawn from; no insert in the tables' statistics: an
-- installation that retention emptied is not new, and consumers of an older version may still
-- run against it, inserting with ON CONFLICT on the old keys), and no relay (nor retention run)
-- holding its locks on the outbox (they are keyed by its oid, which this changes). An existing
-- installation keeps its tables, and works as before, until converted.

-- A new partition's indexes are named after its table's (`outbox_event_event_id_key_20261203_0000`
-- rather than the name `LIKE` makes up, `outbox_event_20261203_0000_event_id_created_at_key`), so
-- that an error names the key an operator knows: a duplicate event id in one unit of work says
-- `outbox_event_event_id_key`, as it did before partitions. It runs in the transaction that
-- attaches the new partition, before anything can write to it.
CREATE FUNCTION outbox_name_partition_indexes(partition regclass, suffix text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    idx record;
BEGIN
    FOR idx IN
        SELECT i.indexrelid::regclass AS own, p.relname AS parents
        FROM pg_index i
        JOIN pg_inherits h ON h.inhrelid = i.indexrelid
        JOIN pg_class p ON p.oid = h.inhparent
        WHERE i.indrelid = partition
    LOOP
        EXECUTE format('ALTER INDEX %s RENAME TO %I', idx.own,
                       left(idx.parents, 62 - length(suffix)) || '_' || suffix);
    END LOOP;
END
$$;

-- `outbox_create_partitions` again: each new partition's indexes named after its table's
-- (above). The rest is as in `..._015_inbox_event_partitions`, whose comments and those of
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
            PERFORM outbox_name_partition_indexes(format('%I.%I', schema, name)::regclass,
                                                  'history');
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
            PERFORM outbox_name_partition_indexes(format('%I.%I', schema, name)::regclass,
                to_char(start_at AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MI'));
            created := created + 1;
        END IF;
        start_at := start_at + settings.width;
    END LOOP;
    PERFORM set_config('lock_timeout', timeout, true);
    RETURN created;
END
$$;

DO $$
BEGIN
    -- Locked first: nothing commits a row between the check and the swap.
    LOCK TABLE outbox_event, inbox_event, processed_event IN ACCESS EXCLUSIVE MODE;
    IF EXISTS (SELECT 1 FROM outbox_event) OR EXISTS (SELECT 1 FROM inbox_event)
       OR EXISTS (SELECT 1 FROM processed_event)
       OR (SELECT relkind FROM pg_class WHERE oid = 'outbox_event'::regclass) = 'r'
          AND pg_sequence_last_value(pg_get_serial_sequence('outbox_event', 'id')::regclass)
              IS NOT NULL
       OR EXISTS (SELECT 1 FROM pg_stat_all_tables s
                  LEFT JOIN pg_inherits i ON i.inhrelid = s.relid
                  WHERE coalesce(i.inhparent, s.relid) IN ('outbox_event'::regclass,
                            'inbox_event'::regclass, 'processed_event'::regclass)
                    AND s.n_tup_ins > 0)
       OR EXISTS (SELECT 1 FROM pg_locks
                  WHERE locktype = 'advisory' AND classid = 'outbox_event'::regclass::oid
                    AND pid <> pg_backend_pid()
                    AND database = (SELECT oid FROM pg_database
                                    WHERE datname = current_database())) THEN
        RETURN;
    END IF;

    IF (SELECT relkind FROM pg_class WHERE oid = 'outbox_event'::regclass) = 'r' THEN
        ALTER TABLE outbox_event RENAME TO outbox_event_unpartitioned;
        CREATE TABLE outbox_event (
            LIKE outbox_event_unpartitioned INCLUDING DEFAULTS INCLUDING IDENTITY
        ) PARTITION BY RANGE (created_at);
        DROP TABLE outbox_event_unpartitioned;
        EXECUTE format('ALTER SEQUENCE %s RENAME TO outbox_event_id_seq',
                       pg_get_serial_sequence('outbox_event', 'id'));
        ALTER TABLE outbox_event
            ADD CONSTRAINT outbox_event_pkey PRIMARY KEY (id, created_at),
            ADD CONSTRAINT outbox_event_event_id_key UNIQUE (event_id, created_at);
        CREATE INDEX ix_outbox_event_unpublished ON outbox_event (id) WHERE published_at IS NULL;
        CREATE INDEX ix_outbox_event_retrying ON outbox_event (partition_key)
            WHERE published_at IS NULL AND next_attempt_at IS NOT NULL;
        CREATE INDEX ix_outbox_event_parked ON outbox_event (id) WHERE parked_at IS NOT NULL;
        CREATE INDEX ix_outbox_event_published_at ON outbox_event (published_at)
            WHERE published_at IS NOT NULL;
        PERFORM outbox_create_partitions('outbox_event');
    END IF;

    IF (SELECT relkind FROM pg_class WHERE oid = 'inbox_event'::regclass) = 'r' THEN
        ALTER TABLE inbox_event RENAME TO inbox_event_unpartitioned;
        CREATE TABLE inbox_event (
            LIKE inbox_event_unpartitioned INCLUDING DEFAULTS
        ) PARTITION BY RANGE (received_at);
        DROP TABLE inbox_event_unpartitioned;
        ALTER TABLE inbox_event ADD CONSTRAINT inbox_event_pkey PRIMARY KEY (event_id, received_at);
        CREATE INDEX ix_inbox_event_unprocessed ON inbox_event (received_at) WHERE NOT processed;
        CREATE INDEX ix_inbox_event_dead ON inbox_event (received_at) WHERE dead_at IS NOT NULL;
        PERFORM outbox_create_partitions('inbox_event');
    END IF;
END
$$;
