#!/usr/bin/env bash
# Sustained load, as an operator's first weeks would bring it: pgbench commits through
# `outbox_emit` at a fixed rate (Poisson arrivals, so in bursts), one `outbox relay` and
# `outbox dev-broker` run as processes of their own, and every 10 s a sample of what stays
# healthy or not: the oldest snapshot of any session of the database (in transactions and in
# seconds of them), the NOTIFY queue, the outbox's dead tuples and unpublished index, the oldest
# unpublished event. One CSV line per sample on stdout (and in $OUT), a summary on stderr.
#
#   RATE=1376 SECONDS_=1200 AUTOVACUUM=on bash tests/scripts/sustained-load.sh
#
# AUTOVACUUM=on turns autovacuum on for the run (ALTER SYSTEM, put back at exit); `off` leaves
# the server as it is. TABLE_AUTOVACUUM=queue (the default) keeps the tables' autovacuum settings
# as the migrations set them; `default` resets them to the server's, for a comparison.
# PREFILL=N writes N published rows first (what a retention window keeps; vacuumed and analyzed
# before the load starts). RELAY_ARGS are added to `outbox relay`'s (e.g. its --warn-* health
# thresholds). HOLD_AT=S opens, S seconds into the load, a session that holds a transaction id
# (and so the cleanup horizon) for HOLD_SECS (default 600) seconds, idle in its transaction; the
# summary says when the relay's log first named it. Needs pgbench and psql, PostgreSQL on $PGHOST:$PGPORT as `postgres`
# with the right to ALTER SYSTEM, and builds the CLI in release.
set -euo pipefail
cd "$(dirname "$0")/../.."

RATE=${RATE:-1376}
SECONDS_=${SECONDS_:-1200}
AUTOVACUUM=${AUTOVACUUM:-on}
TABLE_AUTOVACUUM=${TABLE_AUTOVACUUM:-queue}
PREFILL=${PREFILL:-0}
RELAY_ARGS=${RELAY_ARGS:-}
HOLD_AT=${HOLD_AT:-}
HOLD_SECS=${HOLD_SECS:-600}
CLIENTS=${CLIENTS:-8}
PORT=${PORT:-19092}
OUT=${OUT:-/tmp/outbox-sustained-load.csv}
export PGHOST=${PGHOST:-127.0.0.1} PGPORT=${PGPORT:-5432} PGUSER=${PGUSER:-postgres}
DB=outbox_sustained_load
URL="postgres://${PGUSER}@${PGHOST}:${PGPORT}/${DB}"

cargo build -q --release -p outbox-cli
bin=target/release/outbox
work=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [ "$AUTOVACUUM" = on ]; then
        psql -q -d postgres -c "ALTER SYSTEM RESET autovacuum" -c "SELECT pg_reload_conf()" >/dev/null
    fi
    rm -rf "$work"
}
trap cleanup EXIT

psql -q -d postgres -c "DROP DATABASE IF EXISTS ${DB} WITH (FORCE)" -c "CREATE DATABASE ${DB}"
DATABASE_URL=$URL "$bin" migrate >/dev/null
if [ "$TABLE_AUTOVACUUM" = default ]; then
    for t in outbox_event inbox_event processed_event; do
        psql -q -d "$DB" -c "ALTER TABLE $t RESET (autovacuum_vacuum_scale_factor, \
            autovacuum_vacuum_threshold, autovacuum_vacuum_cost_limit, \
            autovacuum_analyze_scale_factor, autovacuum_analyze_threshold)"
    done
fi
if [ "$AUTOVACUUM" = on ]; then
    psql -q -d postgres -c "ALTER SYSTEM SET autovacuum = on" -c "SELECT pg_reload_conf()" >/dev/null
fi
if [ "$PREFILL" -gt 0 ]; then
    psql -q -d "$DB" -c "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, \
            event_type, payload, topic, partition_key, created_at, published_at) \
        SELECT gen_random_uuid(), 'Account', 'acct-' || (i % 1000), 'Deposited', \
            '{\"amount\": 10, \"note\": \"xxxxxxxxxxxxxxxxxxxx\"}', 'load.events', \
            'acct-' || (i % 1000), now() - interval '1 hour', now() - interval '1 hour' \
        FROM generate_series(1, $PREFILL) AS i" -c "VACUUM ANALYZE outbox_event"
fi
autovacuum=$(psql -Atq -d "$DB" -c "SHOW autovacuum")

"$bin" dev-broker --port "$PORT" --topic load.events >"$work/broker.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 50); do grep -q listening "$work/broker.log" && break; sleep 0.1; done
# shellcheck disable=SC2086 # RELAY_ARGS is a list of arguments
DATABASE_URL=$URL "$bin" relay --brokers "127.0.0.1:$PORT" $RELAY_ARGS >"$work/relay.log" 2>&1 &
pids+=($!)

cat >"$work/emit.sql" <<'SQL'
\set k random(1, 1000)
SELECT outbox_emit(ARRAY[gen_random_uuid()], ARRAY['Account'], ARRAY['acct-' || :k],
                   ARRAY['Deposited'], ARRAY['{"amount": 10, "note": "xxxxxxxxxxxxxxxxxxxx"}'],
                   ARRAY['load.events'], ARRAY['acct-' || :k]);
SQL
pgbench -n -f "$work/emit.sql" -c "$CLIENTS" -j 2 -R "$RATE" -T "$SECONDS_" "$DB" \
    >"$work/pgbench.log" 2>&1 &
bench=$!
pids+=($bench)

sample() {
    psql -Atq -F, -d "$DB" <<'SQL'
WITH s AS (
    SELECT application_name AS app, age(backend_xmin) AS age
    FROM pg_stat_activity
    WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_xmin IS NOT NULL
      AND backend_type = 'client backend'
    ORDER BY age(backend_xmin) DESC LIMIT 1
), t AS (
    SELECT n_tup_ins, n_dead_tup, n_live_tup, autovacuum_count, autoanalyze_count
    FROM pg_stat_user_tables WHERE relname = 'outbox_event'
)
SELECT pg_snapshot_xmax(pg_current_snapshot())::text,
       coalesce((SELECT age FROM s), 0), coalesce((SELECT app FROM s), ''),
       round(pg_notification_queue_usage()::numeric, 8),
       t.n_tup_ins, t.n_dead_tup, t.n_live_tup, t.autovacuum_count, t.autoanalyze_count,
       pg_relation_size('ix_outbox_event_unpublished'),
       pg_total_relation_size('outbox_event'),
       coalesce(round(1000 * extract(epoch FROM clock_timestamp() - (
           SELECT min(created_at) FROM outbox_event WHERE published_at IS NULL))), 0),
       (SELECT count(*) FROM outbox_event WHERE published_at IS NULL)
FROM t
SQL
}

notify_dir() {
    local dir
    dir=$(psql -Atq -d postgres -c "SHOW data_directory" 2>/dev/null)/pg_notify
    du -sb "$dir" 2>/dev/null | cut -f1 || echo ""
}

header="t_s,next_xid,oldest_snapshot_xids,oldest_snapshot_s,oldest_snapshot_app,notify_queue_usage,pg_notify_bytes,inserted,dead_tuples,live_tuples,autovacuums,autoanalyzes,unpublished_index_bytes,outbox_total_bytes,oldest_unpublished_ms,unpublished"
echo "$header" | tee "$OUT"
echo "autovacuum=$autovacuum (tables: $TABLE_AUTOVACUUM) rate=$RATE/s for ${SECONDS_}s, $CLIENTS clients, $PREFILL rows prefilled" >&2
start=$(date +%s)
if [ -n "$HOLD_AT" ]; then
    # psql reads its statements from a pipe: the transaction stays open, idle, until the pipe
    # closes after HOLD_SECS.
    ( sleep "$HOLD_AT"; date +%s >"$work/hold.start"
      { printf "SET application_name = 'forgotten-session';\nBEGIN;\nSELECT txid_current();\n"
        sleep "$HOLD_SECS"; printf "COMMIT;\n"; } | psql -q -d "$DB" >/dev/null ) &
    pids+=($!)
fi
declare -a xids times
while kill -0 "$bench" 2>/dev/null; do
    sleep 10
    now=$(( $(date +%s) - start ))
    IFS=, read -r xid age app usage ins dead live avs aas idx total oldest unpub < <(sample)
    # The age in seconds: when the next transaction id was last at or below the snapshot's.
    times+=("$now"); xids+=("$xid")
    secs=0
    for i in "${!xids[@]}"; do
        if [ "${xids[$i]}" -ge $(( xid - age )) ]; then
            prev=$(( i > 0 ? i - 1 : 0 ))
            secs=$(( now - times[prev] ))
            break
        fi
    done
    [ "$age" -eq 0 ] && secs=0
    echo "$now,$xid,$age,$secs,$app,$usage,$(notify_dir),$ins,$dead,$live,$avs,$aas,$idx,$total,$oldest,$unpub" | tee -a "$OUT"
done
grep -E "tps|latency" "$work/pgbench.log" >&2 || cat "$work/pgbench.log" >&2
grep "outbox health" "$work/relay.log" >&2 || echo "the relay logged no health warning" >&2
if [ -n "$HOLD_AT" ] && [ -f "$work/hold.start" ]; then
    held=$(cat "$work/hold.start")
    named=$(grep -m1 "forgotten-session" "$work/relay.log" | grep -oE '[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+Z' | head -1)
    if [ -n "$named" ]; then
        echo "the horizon-holding session opened at +$(( held - start )) s; the relay's log named it $(( $(date -d "$named" +%s) - held )) s later" >&2
    else
        echo "the relay's log never named the horizon-holding session" >&2
    fi
fi
