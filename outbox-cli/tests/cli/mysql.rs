//! The CLI against a MariaDB database (issue 38): `migrate` applies the MySQL migrations; the
//! commands not built for it yet say so.

use outbox_tests::mysql::{count, MySqlTestDb};

use crate::support::{assert_error, assert_ok, run, stdout};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_applies_the_mysql_migrations_and_other_commands_say_what_works() {
    let db = MySqlTestDb::empty().await;
    let first = run(&db.url, &["migrate"]).await;
    assert_ok(&first);
    let applied = outbox_runtime::mysql::MIGRATIONS.len();
    assert!(
        stdout(&first).contains(&format!("applied {applied} migrations")),
        "{}",
        stdout(&first)
    );
    assert_eq!(
        count(&db.pool, "SELECT COUNT(*) FROM outbox_key_lock").await,
        65_536
    );
    let again = run(&db.url, &["migrate"]).await;
    assert_ok(&again);
    assert!(
        stdout(&again).contains("schema up to date"),
        "{}",
        stdout(&again)
    );
    assert_error(
        &run(&db.url, &["status"]).await,
        "only `outbox migrate` takes a mysql:// URL so far",
    );
}
