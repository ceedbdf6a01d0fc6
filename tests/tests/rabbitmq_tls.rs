//! RabbitMQ over TLS (`amqps://`, feature `rabbitmq-tls`), against a node of the test's own with
//! a TLS listener whose certificate a CA of its own signed: the relay publishes through it
//! when told that CA, and refuses a server it cannot trust, or a certificate file it cannot
//! read, with an error that says so.

use std::time::Duration;

use outbox_runtime::rabbitmq::RabbitMq;
use outbox_runtime::relay::Relay;
use outbox_tests::deposits::{check_delivery, emit_events, wait_until_published, TOPIC};
use outbox_tests::rabbitmq::{declare_queue_bound, read_queue, RabbitNode};
use outbox_tests::{Running, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_publishes_over_tls_to_a_server_it_trusts_and_only_to_one() {
    let node = RabbitNode::start_tls().await;
    let db = TestDb::new().await;
    // What the relay publishes, read back over the plain listener.
    declare_queue_bound(&node.url(), "tls-read", TOPIC, "0").await;

    // A CA that did not sign the server's certificate: nothing gets through, and the reason is
    // the certificate.
    let stranger = RabbitNode::start_tls().await;
    let untrusted = RabbitMq::new(node.tls_url()).tls_ca_certificates(stranger.ca_file());
    let err = untrusted
        .ensure_topology(TOPIC, "billing")
        .await
        .expect_err("a server whose certificate no trusted CA signed");
    let text = outbox_runtime::error_chain(&err).to_string();
    assert!(
        text.to_lowercase().contains("certificate"),
        "the error names the certificate: {text}"
    );
    drop(stranger);

    let relay = Relay::builder(db.pool.clone())
        .rabbitmq(
            RabbitMq::new(node.tls_url())
                .shards(1)
                .tls_ca_certificates(node.ca_file()),
        )
        .poll_interval(Duration::from_millis(100))
        .publish_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    let n = emit_events(&db.pool, 10, 5, 50).await;
    let received = read_queue(&node.url(), "tls-read", n, Duration::from_secs(60)).await;
    wait_until_published(&db.pool, Duration::from_secs(30)).await;
    assert_eq!(check_delivery(&db.pool, &received, n).await, 0);
    running.stop().await;
}

#[tokio::test]
async fn certificate_files_that_cannot_be_used_are_refused_when_the_relay_is_built() {
    let pool = sqlx::PgPool::connect_lazy("postgres://127.0.0.1/unused").unwrap();
    let build = |settings: RabbitMq| {
        Relay::builder(pool.clone())
            .rabbitmq(settings)
            .build()
            .err()
            .map(|e| outbox_runtime::error_chain(&e).to_string())
            .unwrap_or_default()
    };
    let dir = std::env::temp_dir().join(format!("outbox-tls-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let not_pem = dir.join("not.pem");
    std::fs::write(&not_pem, "not a certificate").unwrap();

    let missing = build(
        RabbitMq::new("amqps://guest:guest@localhost:5671").tls_ca_certificates(dir.join("no.pem")),
    );
    assert!(missing.contains("no.pem"), "{missing}");
    let empty = build(RabbitMq::new("amqps://localhost").tls_ca_certificates(&not_pem));
    assert!(empty.contains("no PEM certificate"), "{empty}");
    let half = build(RabbitMq::new(format!(
        "amqps://localhost?certfile={}",
        not_pem.display()
    )));
    assert!(half.contains("certfile and keyfile go together"), "{half}");
    let key = build(
        RabbitMq::new("amqps://localhost").tls_client_certificate(&not_pem, dir.join("none.key")),
    );
    assert!(
        key.contains("no certificate could be read") || key.contains("no PEM"),
        "{key}"
    );
    // No password in any of them.
    let shown = build(
        RabbitMq::new("amqps://app:s3cret@localhost").tls_ca_certificates(dir.join("no.pem")),
    );
    assert!(!shown.contains("s3cret"), "{shown}");
    std::fs::remove_dir_all(&dir).unwrap();
}
