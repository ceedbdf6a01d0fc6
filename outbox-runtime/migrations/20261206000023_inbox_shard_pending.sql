-- Each inbox processor's claim starts at the first row of its own shards (`inbox/shards.rs`),
-- not at the first row anyone can claim: behind a burst of one key, the processors of the
-- other keys' shards would otherwise wait until the burst is nearly done. This index finds
-- that row shard by shard: a key's shard, as the claim computes it (`store/inbox/claim.rs`,
-- the same expression, which the planner matches), and 64 for the rows of no key.
CREATE INDEX ix_inbox_event_shard_pending ON inbox_event
    ((coalesce(hashtext(topic || E'\x1f' || partition_key) & 63, 64)), seq)
    WHERE NOT processed AND dead_at IS NULL;
