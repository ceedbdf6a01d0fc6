-- `processed_event` in time partitions, so that retention drops whole partitions instead of
-- deleting rows (a DELETE leaves dead rows and index entries for vacuum; a dropped partition
-- leaves nothing).
--
-- A partitioned table's unique key must contain its partition key, so the key is now
-- (event_id, handler, processed_at) and uniqueness per (event_id, handler) holds across
-- partitions by how consumers insert (see `inbox/batch.rs`): a transaction-scoped advisory lock
-- per (handler, source topic and partition) first, then an insert of the pairs that no
-- partition holds yet, at READ COMMITTED. Two consumers that handle the same message (a
-- consumer the group has replaced, still finishing its batch) take the same lock, so the second
-- sees the first's row once it commits, whichever partition it is in.
--
-- Partitions are `width` wide, aligned to it, named `processed_event_YYYYMMDD_HHMI` (UTC), and
-- created `ahead` of time by `outbox_create_partitions` (migrations, relays with retention,
-- consumers at start, `outbox partitions`). They are attached, never created with
-- `PARTITION OF`: attaching takes a lock that inserts do not wait for, so creating one never
-- stalls consumers. There is no default partition, which would make every attach lock out
-- inserts while it scans it; the first partition, `processed_event_history`, takes everything
-- before the first boundary (rows of an unpartitioned table converted in place end up there).
--
-- A new installation gets the partitioned table here; an existing one keeps its table, and
-- works as before, until converted (`outbox partitions convert`, once no consumer of an older
-- version runs: those insert with ON CONFLICT alone, which the new key does not catch).

-- The layout of each partitioned table: how wide its partitions are and how far ahead of now
-- they exist. Change them here; a new width applies from the last partition on.
CREATE TABLE outbox_partitioning (
    parent text     PRIMARY KEY,
    width  interval NOT NULL CHECK (width >= interval '1 minute' AND width <= interval '31 days'
                                    AND date_part('month', width) = 0
                                    AND date_part('year', width) = 0
                                    AND date_part('epoch', width)::bigint % 60 = 0),
    ahead  interval NOT NULL CHECK (ahead >= interval '1 hour')
);
INSERT INTO outbox_partitioning (parent, width, ahead)
VALUES ('processed_event', interval '1 day', interval '3 days');

-- A partitioned table's partitions with their bounds (NULL for MINVALUE or MAXVALUE), read
-- from the catalog; `detach_pending` for one whose DETACH ... CONCURRENTLY was interrupted.
CREATE FUNCTION outbox_partitions(parent regclass)
RETURNS TABLE (partition regclass, lower_bound timestamptz, upper_bound timestamptz,
               detach_pending boolean)
LANGUAGE sql STABLE AS $$
    SELECT c.oid::regclass,
           substring(b FROM $r$FROM \('([^']*)'\)$r$)::timestamptz,
           substring(b FROM $r$TO \('([^']*)'\)$r$)::timestamptz,
           i.inhdetachpending
    FROM pg_inherits i
    JOIN pg_class c ON c.oid = i.inhrelid
    CROSS JOIN LATERAL pg_get_expr(c.relpartbound, c.oid) AS b
    WHERE i.inhparent = parent
    ORDER BY 3 NULLS LAST
$$;

-- Creates `parent`'s partitions from the last one's upper bound until `ahead` past now; returns
-- how many it created. A table without partitions gets a first one that takes everything
-- before the start of `since`'s width (default now), then partitions from there. A table that is not partitioned gets
-- none (0). One call at a time per table (an advisory lock); each attach waits at most 5 s for
-- its lock (a long transaction reading the table): on a timeout the call fails and creates
-- nothing, and the next call tries again.
CREATE FUNCTION outbox_create_partitions(parent regclass, since timestamptz DEFAULT NULL)
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
        EXECUTE format('CREATE TABLE %I.%I (LIKE %s INCLUDING DEFAULTS INCLUDING INDEXES)',
                       schema, name, parent);
        EXECUTE format('ALTER TABLE %s ATTACH PARTITION %I.%I FOR VALUES FROM (MINVALUE) TO (%L)',
                       parent, schema, name, start_at);
        created := created + 1;
    END IF;
    WHILE start_at < now() + settings.ahead LOOP
        name := base || '_' || to_char(start_at AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MI');
        EXECUTE format('CREATE TABLE %I.%I (LIKE %s INCLUDING DEFAULTS INCLUDING INDEXES)',
                       schema, name, parent);
        -- The bounds as a constraint first, so that the attach need not scan (the table is
        -- empty anyway) and the partition keeps saying what it holds.
        EXECUTE format('ALTER TABLE %I.%I ADD CONSTRAINT %I CHECK (%I >= %L AND %I < %L)',
                       schema, name, name || '_bounds', keycol, start_at, keycol,
                       start_at + settings.width);
        EXECUTE format('ALTER TABLE %s ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
                       parent, schema, name, start_at, start_at + settings.width);
        start_at := start_at + settings.width;
        created := created + 1;
    END LOOP;
    PERFORM set_config('lock_timeout', timeout, true);
    RETURN created;
END
$$;

-- A new installation (no row in any of the three tables: consumers of an older version, which
-- would not deduplicate against this table, cannot have been running): nothing to keep, so the
-- table is replaced by the partitioned one.
DO $$
BEGIN
    -- Locked first: no consumer commits a record between the check and the drop.
    LOCK TABLE processed_event IN ACCESS EXCLUSIVE MODE;
    IF NOT EXISTS (SELECT 1 FROM processed_event) AND NOT EXISTS (SELECT 1 FROM outbox_event)
       AND NOT EXISTS (SELECT 1 FROM inbox_event) THEN
        DROP TABLE processed_event;
        CREATE TABLE processed_event (
            event_id     uuid        NOT NULL,
            handler      text        NOT NULL,
            processed_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (event_id, handler, processed_at)
        ) PARTITION BY RANGE (processed_at);
        PERFORM outbox_create_partitions('processed_event');
    END IF;
END
$$;
