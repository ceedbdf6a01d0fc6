//! A record the producer refused as too large, parked by a real relay: the list and the event
//! page say its payload's size and the limit it met, beside the error.

use std::time::Duration;

use outbox_runtime::console::ConsoleSettings;
use outbox_runtime::Uow;
use outbox_tests::browser::{thousands, Browser, Served};
use outbox_tests::deposits::{deposit, relay_on, PARTITIONS, TOPIC};
use outbox_tests::kafka::Kafka;
use outbox_tests::payments::wait_for;
use outbox_tests::{Running, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_too_large_is_listed_with_its_size_and_the_limit_it_met() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let mut event = deposit(1, 0);
    event.note = "z".repeat(20_000);
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    let event_id = uow.emit(&event).await.unwrap();
    uow.commit().await.unwrap();
    let mut config = rdkafka::ClientConfig::new();
    config.set("message.max.bytes", "10000");
    let relay = relay_on(&db.pool, &kafka)
        .producer_config(config)
        .brokers(kafka.bootstrap())
        .max_attempts(1)
        .build()
        .unwrap();
    let running = Running::relay(&relay);
    wait_for("parked", Duration::from_secs(30), || async {
        relay.status().await.unwrap().parked == 1
    })
    .await;
    running.stop().await;
    let (id, bytes): (i64, i64) = sqlx::query_as(
        "SELECT id, octet_length(payload::text)::int8 FROM outbox_event WHERE event_id = $1",
    )
    .bind(event_id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let said = format!("its payload is {} bytes", thousands(bytes));

    let served = Served::start(&db.pool, ConsoleSettings::default()).await;
    let browser = Browser::start().await;
    browser.client.goto(&served.url("/parked")).await.unwrap();
    let error = browser
        .client
        .find(fantoccini::Locator::Css(&format!(
            "tr[data-id='{id}'] td.error"
        )))
        .await
        .unwrap()
        .attr("title")
        .await
        .unwrap()
        .unwrap_or_default();
    assert!(
        error.contains(&said) && error.contains("message.max.bytes = 10000"),
        "the list's error: {error}"
    );
    let size = browser
        .text(&format!("tr[data-id='{id}'] td.payload .size"))
        .await;
    assert!(size.contains("kB"), "{size}");
    browser
        .client
        .goto(&served.url(&format!("/event?id={id}")))
        .await
        .unwrap();
    let last = browser.text("#outbox-row dd.last-error").await;
    assert!(
        last.contains(&said) && last.contains("the producer refused it before sending"),
        "the event page's error: {last}"
    );
    browser.screenshot("event-too-large").await;
    browser.close().await;
}
