-- `outbox_event` in time partitions (by `created_at`), as `inbox_event` can be since
-- `..._015_inbox_event_partitions`: retention drops a whole partition once every row in it is
-- published, none within the retention window, and it ended before that window, instead of
-- deleting rows; it never drops one that holds an unpublished or parked row (it is kept and
-- reported, see `outbox_partition_kept`).
--
-- The keys hold the partition column, as a partitioned table's unique keys must: the primary
-- key is (id, created_at), and `outbox_event_event_id_key` is (event_id, created_at). `id`
-- stays unique by its identity sequence (the relay's cursor and horizon read it as before).
-- An event id is refused twice within one transaction (its rows share `created_at`, the
-- transaction's start), as before; a later transaction that emits an id again is no longer
-- refused, and consumers take its event for a redelivery (see docs/operations.md).
--
-- The partition column is the database's clock, not the event id: event ids are UUIDv7 when
-- the framework makes them, but an event may bring its own (a v4, a v5), which no time range
-- could place.
--
-- Opt-in in this version, for new installations too: the table stays as it is, and works as
-- before, until converted (`outbox partitions convert --table outbox`, with the relays stopped:
-- they lock their shards under the table's oid, which the conversion changes).

-- Outbox rows are updated once each (published): the queue settings of
-- `..._011_queue_autovacuum`, which says why, on each partition.
INSERT INTO outbox_partitioning (parent, width, ahead, partition_options)
VALUES ('outbox_event', interval '1 day', interval '3 days',
        'autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000, '
        'autovacuum_vacuum_cost_limit = 2000, autovacuum_analyze_scale_factor = 0, '
        'autovacuum_analyze_threshold = 50000');
