-- `outbox_create_partitions` again, for a caller whose transaction is not at READ COMMITTED
-- (a role or database whose default is REPEATABLE READ, say): its snapshot is taken before it
-- waits for the creators' lock, so the catalog rows it reads afterwards (the last partition's
-- bound) may not show what the creator it waited for made, and it set out to create the same
-- partitions again ("relation already exists"). It now skips a partition whose table exists
-- (a name lookup sees every committed table, whatever the snapshot). The rest is as in
-- `..._013_processed_event_partitions`, whose comments say why.

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
            -- The bounds as a constraint first, so that the attach need not scan (the table
            -- is empty anyway) and the partition keeps saying what it holds.
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
