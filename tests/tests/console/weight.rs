//! A page of parked or dead rows whose payloads are a megabyte each: the lists show each
//! payload's size and the start of a small one, never the payloads; the event page shows a
//! large payload's size, and the payload itself on request.

use outbox_runtime::console::ConsoleSettings;
use outbox_tests::browser::{Browser, Served};
use outbox_tests::TestDb;
use sqlx::PgPool;

use super::park;

/// A JSON document of about `bytes` bytes that does not compress (hex digits), as one SQL
/// expression: `jsonb_build_object('seq', i, 'doc', <hex>)`, `i` the row's number.
fn large_payload(bytes: i64) -> String {
    format!(
        "jsonb_build_object('seq', i, 'doc', \
           (SELECT string_agg(md5(g::text), '') FROM generate_series(1, {}) AS g))",
        bytes / 32
    )
}

/// Parks `n` rows of `topic` with payloads of about `bytes` bytes each, refused as too large.
pub(crate) async fn park_large(pool: &PgPool, topic: &str, n: i64, bytes: i64) {
    sqlx::query(&format!(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key, attempts, last_error, parked_at) \
         SELECT gen_random_uuid(), 'Document', i::text, 'DocumentStored', {}, $1, \
                'doc-' || i, 3, \
                'Message production error: MessageSizeTooLarge (Broker: Message size too large)', \
                now() \
         FROM generate_series(1, $2) AS i",
        large_payload(bytes)
    ))
    .bind(topic)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

/// `n` dead inbox rows of `topic` with payloads of about `bytes` bytes each.
async fn dead_large(pool: &PgPool, topic: &str, n: i64, bytes: i64) {
    sqlx::query(&format!(
        "INSERT INTO inbox_event (event_id, payload, topic, event_type, attempts, last_error, \
                                  dead_at) \
         SELECT gen_random_uuid(), {}, $1, 'DocumentStored', 5, 'handler failed', now() \
         FROM generate_series(1, $2) AS i",
        large_payload(bytes)
    ))
    .bind(topic)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

/// The size of a row's payload as JSON text (what the relay sends).
async fn json_bytes(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_megabyte_payloads_stays_light_and_says_their_sizes() {
    let db = TestDb::new().await;
    // As the operator met it: payloads of 1.15 MB the broker refused, more than a page of them.
    park_large(&db.pool, "docs.events", 51, 1_150_000).await;
    park(&db.pool, "audit.events", 1).await;
    dead_large(&db.pool, "docs.events", 51, 300_000).await;
    let served = Served::start(&db.pool, ConsoleSettings::default()).await;
    let browser = Browser::start().await;

    browser
        .client
        .goto(&served.url("/parked?topic=docs.events"))
        .await
        .unwrap();
    let bytes = browser.page_bytes().await;
    println!("parked, a page of 50 rows of 1.15 MB: {bytes} bytes of HTML");
    assert!(bytes < 200 * 1024, "the page weighs {bytes} bytes");
    assert_eq!(browser.count("#rows tbody tr").await, 50);
    assert_eq!(browser.count("#next").await, 1, "a next page");
    // Each row says how large its payload is.
    let first: i64 =
        sqlx::query_scalar("SELECT min(id) FROM outbox_event WHERE topic = 'docs.events'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let size = browser
        .text(&format!("tr[data-id='{first}'] td.payload .size"))
        .await;
    assert!(size.contains("1.15 MB"), "{size}");
    browser.screenshot("parked-large-payloads").await;

    // A small payload: its exact size and its start.
    browser
        .client
        .goto(&served.url("/parked?topic=audit.events"))
        .await
        .unwrap();
    let small = json_bytes(
        &db.pool,
        "SELECT octet_length(payload::text)::int8 FROM outbox_event WHERE topic = 'audit.events'",
    )
    .await;
    let cell = browser.text("#rows tbody tr td.payload").await;
    assert!(cell.contains(&format!("{small} B")), "{cell}");
    assert!(cell.contains("\"seq\""), "{cell}");

    // The dead list too.
    browser.client.goto(&served.url("/dead")).await.unwrap();
    let bytes = browser.page_bytes().await;
    println!("dead, a page of 50 rows of 300 kB: {bytes} bytes of HTML");
    assert!(bytes < 200 * 1024, "the page weighs {bytes} bytes");
    assert_eq!(browser.count("#rows tbody tr").await, 50);

    // The event page: the payload's exact size, and the payload itself on request.
    browser
        .client
        .goto(&served.url(&format!("/event?id={first}")))
        .await
        .unwrap();
    let bytes = browser.page_bytes().await;
    assert!(bytes < 200 * 1024, "the event page weighs {bytes} bytes");
    let exact = json_bytes(
        &db.pool,
        &format!("SELECT octet_length(payload::text)::int8 FROM outbox_event WHERE id = {first}"),
    )
    .await;
    let said = browser.text("#outbox-row .payload-size").await;
    assert!(
        said.contains(&outbox_tests::browser::thousands(exact)),
        "{said} (the payload is {exact} bytes)"
    );
    let whole = browser
        .client
        .find(fantoccini::Locator::Css("#outbox-row a.payload-whole"))
        .await
        .expect("a link to the whole payload")
        .attr("href")
        .await
        .unwrap()
        .unwrap();
    let (code, response) = served.request("GET", &whole, &[], "").await;
    assert_eq!(code, 200);
    let body = response.split_once("\r\n\r\n").unwrap().1;
    let stored: String = sqlx::query_scalar(&format!(
        "SELECT payload::text FROM outbox_event WHERE id = {first}"
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(body.len(), stored.len());
    assert!(body == stored, "the payload as the relay sends it");
    browser.screenshot("event-large-payload").await;
    browser.close().await;
}
