//! A running relay's health checks on MariaDB: on the relay's schedule, its warnings in the
//! log and counted in `outbox_health_warnings{kind}`, as on PostgreSQL (their own test binary:
//! the log's subscriber and the metrics recorder are process-wide).

use std::time::Duration;

use metrics_util::debugging::DebuggingRecorder;
use outbox_runtime::relay::Relay;
use outbox_runtime::Uow;
use outbox_tests::deposits::{deposit, TOPIC};
use outbox_tests::kafka::Kafka;
use outbox_tests::log::Log;
use outbox_tests::metrics::labelled_gauge;
use outbox_tests::mysql::MySqlTestDb;
use outbox_tests::Running;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_relay_checks_the_outbox_health_and_logs_its_warnings() {
    let log = Log::install(tracing::Level::INFO);
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");
    let gauge = |name: &str, label: (&str, &str)| labelled_gauge(&snapshotter, name, label);

    let db = MySqlTestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, 1).await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit_all(&[deposit(1, 0), deposit(2, 0)]).await.unwrap();
    uow.commit().await.unwrap();
    // One row parked (the broker refused it too often): a warning that stands.
    sqlx::query(
        "UPDATE outbox_event SET parked_at = UTC_TIMESTAMP(6), attempts = 10, \
             last_error = 'Message size too large' ORDER BY id LIMIT 1",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let relay = Relay::builder(db.pool.clone())
        .brokers(kafka.bootstrap())
        .poll_interval(Duration::from_millis(100))
        .health_interval(Duration::from_secs(1))
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let line = loop {
        let text = log.text();
        if let Some(line) = text.lines().find(|l| l.contains("outbox health: ")) {
            break line.to_owned();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no health warning logged:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        line.contains("WARN") && line.contains("kind=parked"),
        "{line}"
    );
    assert!(line.contains(TOPIC), "{line}");
    assert_eq!(
        gauge("outbox_health_warnings", ("kind", "parked")),
        Some(1.0)
    );
    assert_eq!(
        gauge("outbox_health_warnings", ("kind", "held_keys")),
        Some(0.0),
        "every kind is reported, 0 when none stands"
    );
    // Dropped: the warning clears at the next check.
    outbox_runtime::mysql::drop_parked(&db.pool, &outbox_runtime::admin::PoisonFilter::all())
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !log.text().contains("outbox health: cleared") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the warning never cleared:\n{}",
            log.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        gauge("outbox_health_warnings", ("kind", "parked")),
        Some(0.0)
    );
    running.stop().await;

    // A relay whose user lacks the PROCESS privilege (InnoDB's transaction tables need it)
    // still warns of the backlog, and says once which checks it leaves out.
    let user = format!("nop_{}", std::process::id());
    let created = std::process::Command::new("mariadb")
        .args([
            "-u",
            "root",
            "-e",
            &format!(
                "CREATE USER IF NOT EXISTS '{user}'@'127.0.0.1' IDENTIFIED BY 'nop'; \
                 GRANT ALL PRIVILEGES ON `{}`.* TO '{user}'@'127.0.0.1'",
                db.name
            ),
        ])
        .status();
    assert!(
        created.is_ok_and(|s| s.success()),
        "create a user without PROCESS"
    );
    sqlx::query(
        "UPDATE outbox_event SET topic = 'noprocess.events', parked_at = UTC_TIMESTAMP(6), \
             attempts = 10, last_error = 'refused' ORDER BY id LIMIT 1",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let url = db.url.replace("outbox:outbox@", &format!("{user}:nop@"));
    let limited = sqlx::MySqlPool::connect(&url).await.unwrap();
    let relay = Relay::builder(limited.clone())
        .brokers(kafka.bootstrap())
        .health_interval(Duration::from_secs(1))
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !log
        .text()
        .lines()
        .any(|l| l.contains("outbox health: ") && l.contains("noprocess.events"))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no backlog warning without PROCESS:\n{}",
            log.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(log.text().contains("PROCESS"), "{}", log.text());
    running.stop().await;
    limited.close().await;
    let _ = std::process::Command::new("mariadb")
        .args([
            "-u",
            "root",
            "-e",
            &format!("DROP USER IF EXISTS '{user}'@'127.0.0.1'"),
        ])
        .status();
}
