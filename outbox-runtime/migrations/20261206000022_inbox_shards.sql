-- Inbox processors hold shards of the partition keys (session advisory locks, as relays do;
-- see `inbox/shards.rs`) instead of a lock per key taken in each claim: a processor's claim
-- reads the rows of its own shards in `seq` order and no longer checks, key by key, that what
-- it claimed is the key's head. Nothing reads each key's pending rows any more; receipts stop
-- writing the index that served that check.
DROP INDEX IF EXISTS ix_inbox_event_key_pending;
