//! The lazy-marking experiment (issue 21): what marking rows published costs the database, today
//! (each row's `published_at` set by an `UPDATE`, a new version of the row and of its index
//! entries) against the best case of marking lazily (the relay records how far each shard got
//! in a progress row, one small update per batch, and the rows are never written again).
//!
//! Both run the relay's database work alone, no broker, on a new installation's (partitioned)
//! outbox: claim a batch after the cursor in `id` order, mark it, commit; until the backlog is
//! gone. The lazy variant is its best case: no failure, no held key, no parked row (each
//! would need a record of its own beside the progress row, and every reader of "unpublished" a
//! join with it). Per round, a fresh backlog of N rows in each design, alternating which goes
//! first; medians of ROUNDS rounds: rows per second, WAL bytes per row, the outbox's growth
//! per row (heap and indexes, bytes) and its dead rows after the round (autovacuum as the
//! server has it: the output says which).
//!
//! `cargo bench -p outbox-tests --bench marking` (N=100000 BATCH=500 ROUNDS=5).

use std::time::Instant;

use outbox_tests::bench::{env, median};
use outbox_tests::TestDb;
use sqlx::{PgPool, Row};

/// One design's figures of one round.
struct Figures {
    rate: f64,
    wal_per_row: f64,
    growth_per_row: f64,
    dead: i64,
}

#[derive(Clone, Copy, PartialEq)]
enum Design {
    /// Today: `UPDATE ... SET published_at = now()` per claimed row.
    Update,
    /// Best case of lazy marking: one progress row per shard, updated once per batch.
    Progress,
    /// The same, its claim still locking the rows (`FOR UPDATE SKIP LOCKED`, as today's): what
    /// the lock alone costs.
    LockedProgress,
}

async fn backlog(pool: &PgPool, n: i64) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
             topic, partition_key) \
         SELECT gen_random_uuid(), 'Account', 'k-' || (i % 1000), 'Deposited', \
             jsonb_build_object('seq', i, 'account', 'k-' || (i % 1000), \
                                'note', repeat('x', 120)), \
             'bench.events', 'k-' || (i % 1000) \
         FROM generate_series(1, $1) AS i",
    )
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE outbox_event")
        .execute(pool)
        .await
        .unwrap();
}

async fn scalar_i64(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

const SIZE_SQL: &str = "SELECT coalesce(sum(pg_total_relation_size(partition)), 0)::int8 \
                        FROM outbox_partitions('outbox_event')";
const DEAD_SQL: &str = "SELECT coalesce(sum(n_dead_tup), 0)::int8 FROM pg_stat_all_tables \
                        WHERE relid IN (SELECT partition FROM outbox_partitions('outbox_event'))";
const WAL_SQL: &str = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8";

async fn round(pool: &PgPool, design: Design, n: i64, batch: i64) -> Figures {
    backlog(pool, n).await;
    let mut conn = pool.acquire().await.unwrap();
    let cursor_sql = match design {
        Design::Update => {
            "SELECT coalesce(max(id), 0) FROM outbox_event WHERE published_at IS NOT NULL"
        }
        Design::Progress | Design::LockedProgress => {
            "SELECT coalesce(max(through), 0) FROM bench_progress"
        }
    };
    let mut cursor: i64 = sqlx::query_scalar(cursor_sql)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let size = scalar_i64(pool, SIZE_SQL).await;
    let wal = scalar_i64(pool, WAL_SQL).await;
    let started = Instant::now();
    let mut done = 0i64;
    loop {
        let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
        let rows = match design {
            Design::Update => sqlx::query(
                "SELECT id, created_at, payload FROM outbox_event \
                 WHERE id > $1 AND published_at IS NULL AND parked_at IS NULL \
                 ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED",
            ),
            Design::Progress => sqlx::query(
                "SELECT id, created_at, payload FROM outbox_event \
                 WHERE id > $1 ORDER BY id LIMIT $2",
            ),
            Design::LockedProgress => sqlx::query(
                "SELECT id, created_at, payload FROM outbox_event \
                 WHERE id > $1 ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED",
            ),
        }
        .bind(cursor)
        .bind(batch)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        let Some(last) = rows.last() else {
            break;
        };
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        cursor = last.get(0);
        match design {
            Design::Update => {
                sqlx::query(
                    "UPDATE outbox_event SET published_at = now(), next_attempt_at = NULL, \
                     held_at = NULL WHERE id = ANY($1)",
                )
                .bind(&ids)
                .execute(&mut *tx)
                .await
                .unwrap();
            }
            Design::Progress | Design::LockedProgress => {
                sqlx::query("UPDATE bench_progress SET through = $1 WHERE shard = 0")
                    .bind(cursor)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
            }
        }
        tx.commit().await.unwrap();
        done += ids.len() as i64;
    }
    let elapsed = started.elapsed();
    assert_eq!(done, n, "every row of the backlog marked");
    let wal = scalar_i64(pool, WAL_SQL).await - wal;
    let growth = scalar_i64(pool, SIZE_SQL).await - size;
    // The session's counts reach the statistics views when it next goes idle.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("SELECT 1").execute(&mut *conn).await.unwrap();
    drop(conn);
    Figures {
        rate: n as f64 / elapsed.as_secs_f64(),
        wal_per_row: wal as f64 / n as f64,
        growth_per_row: growth as f64 / n as f64,
        dead: scalar_i64(pool, DEAD_SQL).await,
    }
}

#[tokio::main]
async fn main() {
    let n: i64 = env("N", 100_000);
    let batch: i64 = env("BATCH", 500);
    let rounds: usize = env("ROUNDS", 5);
    let update = TestDb::new().await;
    let progress = TestDb::new().await;
    let locked = TestDb::new().await;
    for db in [&progress, &locked] {
        sqlx::raw_sql(
            "CREATE TABLE bench_progress (shard int PRIMARY KEY, through int8 NOT NULL); \
             INSERT INTO bench_progress VALUES (0, 0)",
        )
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
        .fetch_one(&update.pool)
        .await
        .unwrap();
    println!(
        "marking {n} rows a round, batches of {batch}, {rounds} rounds, autovacuum {autovacuum}"
    );
    let designs = [
        (&update.pool, Design::Update),
        (&progress.pool, Design::Progress),
        (&locked.pool, Design::LockedProgress),
    ];
    let mut figures: [Vec<Figures>; 3] = [vec![], vec![], vec![]];
    for r in 0..rounds {
        let mut order = [0, 1, 2];
        order.rotate_left(r % 3);
        for which in order {
            let (pool, design) = designs[which];
            figures[which].push(round(pool, design, n, batch).await);
        }
    }
    let med = |f: &[Figures], pick: fn(&Figures) -> f64| median(f.iter().map(pick).collect());
    let base = med(&figures[0], |f| f.rate);
    println!(
        "{:<34} {:>10} {:>7} {:>10} {:>12} {:>10}",
        "design", "rows/s", "ratio", "WAL B/row", "growth B/row", "dead rows"
    );
    for (name, f) in [
        ("UPDATE published_at (today)", &figures[0]),
        ("progress row per shard (lazy)", &figures[1]),
        ("lazy, the claim locking its rows", &figures[2]),
    ] {
        let rate = med(f, |f| f.rate);
        println!(
            "{:<34} {:>10.0} {:>6.2}x {:>10.0} {:>12.0} {:>10}",
            name,
            rate,
            rate / base,
            med(f, |f| f.wal_per_row),
            med(f, |f| f.growth_per_row),
            f.last().map_or(0, |f| f.dead)
        );
    }
}
