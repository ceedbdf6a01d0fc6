//! The vacuum warning on the console's banner says what is true. A fresh installation whose
//! outbox partition opened hours before it (partitions start at a round hour or midnight) has
//! never been vacuumed and is minutes old: its dead rows are no overdue vacuum. An
//! installation hours old with the same partition never vacuumed is warned about, as never
//! vacuumed, never as "last vacuumed" at the partition's lower bound.

use std::time::Duration;

use outbox_runtime::admin::CleanupTable;
use outbox_runtime::console::ConsoleSettings;
use outbox_tests::browser::{Browser, Served};
use outbox_tests::{count, fixtures, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_rows_of_a_fresh_installation_are_no_overdue_vacuum_and_an_old_ones_are_never_vacuumed(
) {
    let db = TestDb::new().await;
    let pool = &db.pool;
    // Hourly partitions from three hours back, as a new installation's daily ones start at
    // midnight: the partition of 90 minutes ago opened long before this installation.
    fixtures::narrow_partitions(
        pool,
        CleanupTable::Outbox,
        Duration::from_secs(3600),
        "now() - interval '3 hours'",
    )
    .await;
    // Whatever the server's setting, no vacuum comes in between.
    sqlx::raw_sql(
        "DO $$ DECLARE p regclass; BEGIN \
           FOR p IN SELECT partition FROM outbox_partitions('outbox_event') LOOP \
             EXECUTE format('ALTER TABLE %s SET (autovacuum_enabled = off)', p); \
           END LOOP; \
         END $$",
    )
    .execute(pool)
    .await
    .unwrap();
    // 12,000 events written 90 minutes ago (a transaction that began then) and published:
    // 12,000 dead row versions in that partition.
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key, created_at) \
         SELECT gen_random_uuid(), 'A', 'a', 'E', '{}', 't', 'k', now() - interval '90 minutes' \
         FROM generate_series(1, 12000)",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("UPDATE outbox_event SET published_at = now()")
        .execute(pool)
        .await
        .unwrap();
    let partition: String =
        sqlx::query_scalar("SELECT tableoid::regclass::text FROM outbox_event LIMIT 1")
            .fetch_one(pool)
            .await
            .unwrap();
    // The statistics lag the table by a moment.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while count(
        pool,
        &format!(
            "SELECT coalesce(max(n_dead_tup), 0) FROM pg_stat_all_tables \
             WHERE relid = '{partition}'::regclass"
        ),
    )
    .await
        < 12_000
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no dead rows counted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let served = Served::start(
        pool,
        ConsoleSettings::default()
            .sample_interval(Duration::from_secs(1))
            .refresh_interval(Duration::from_secs(1)),
    )
    .await;
    let browser = Browser::start().await;
    browser.client.goto(&served.url("/")).await.unwrap();
    let banner = browser.text("#warnings").await;
    assert!(
        !banner.contains("vacuumed"),
        "a minute-old installation's partition is not overdue: {banner}"
    );
    assert_eq!(
        browser
            .count("#warnings li[data-kind='vacuum_overdue']")
            .await,
        0
    );
    browser.screenshot("vacuum-fresh-installation").await;

    // The same partition in an installation three hours old: never vacuumed, for longer than
    // the threshold (an hour).
    sqlx::query("UPDATE outbox_schema_migrations SET applied_at = applied_at - interval '3 hours'")
        .execute(pool)
        .await
        .unwrap();
    let warning = browser
        .wait_for_text("#page", Duration::from_secs(20), |t| {
            t.contains("vacuum_overdue")
        })
        .await;
    let warning = warning
        .lines()
        .find(|l| l.contains("vacuum_overdue"))
        .unwrap()
        .to_owned();
    assert!(
        warning.contains(&format!(
            "partition {partition} of outbox_event has never been vacuumed"
        )) && warning.contains("12,000 dead rows")
            && !warning.contains("last vacuumed"),
        "{warning}"
    );
    browser.screenshot("vacuum-old-installation").await;

    // Vacuumed: the warning goes.
    sqlx::query(&format!("VACUUM {partition}"))
        .execute(pool)
        .await
        .unwrap();
    browser
        .wait_for_text("#page", Duration::from_secs(20), |t| {
            !t.contains("vacuum_overdue")
        })
        .await;
    browser.close().await;
}
