-- Each inbox processor's claim starts at the first row of its own shards (`inbox/shards.rs`),
-- not at the first row anyone can claim: behind a burst of one key, the processors of the
-- other keys' shards would otherwise wait until the burst is nearly done. This index finds
-- that row shard by shard: a key's shard, as the claim computes it (`store/inbox/claim.rs`,
-- the same expression, which the planner matches), and 64 for the rows of no key.
--
-- Its condition says `processed IS NOT TRUE` (the same rows: `processed` is never NULL) where
-- `ix_inbox_event_pending`'s says `NOT processed`, and the claim's lookup says the same: the
-- planner cannot prove that index's condition from the lookup's, so a plan made while a
-- partition was empty (which a session keeps) can only look a shard's first row up here,
-- never walk that index's rows in `seq` order testing each one's shard.
CREATE INDEX ix_inbox_event_shard_pending ON inbox_event
    ((coalesce(hashtext(topic || E'\x1f' || partition_key) & 63, 64)), seq)
    WHERE processed IS NOT TRUE AND dead_at IS NULL;
