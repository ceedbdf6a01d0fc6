//! After an action, the page the operator lands on shows what is true now: the health
//! warnings and the overview's figures too, not the last sample's.

use std::time::Duration;

use fantoccini::Locator;
use outbox_runtime::console::ConsoleSettings;
use outbox_tests::browser::{Browser, Served, TOKEN};
use outbox_tests::TestDb;

use super::{confirm_dialog, park};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_retry_the_warnings_and_figures_are_those_of_now() {
    let db = TestDb::new().await;
    park(&db.pool, "docs.events", 2).await;
    // A sample an hour: without a fresh check the page would show the first page's figures
    // for an hour.
    let served = Served::start(
        &db.pool,
        ConsoleSettings::default()
            .allow_actions(TOKEN)
            .sample_interval(Duration::from_secs(3600)),
    )
    .await;
    let browser = Browser::start().await;
    browser.sign_in(&served, TOKEN).await;
    browser.client.goto(&served.url("/")).await.unwrap();
    let parked = "#outbox-topics tr[data-topic='docs.events'] td.parked";
    assert_eq!(browser.text(parked).await, "2");
    browser.client.goto(&served.url("/parked")).await.unwrap();
    let warning = "#warnings li[data-kind='parked']";
    assert!(browser.text(warning).await.contains("has 2 parked"));

    let id: i64 = sqlx::query_scalar("SELECT min(id) FROM outbox_event")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    browser
        .client
        .find(Locator::Css(&format!(
            "tr[data-id='{id}'] button.act-retried"
        )))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    confirm_dialog(&browser).await;
    assert!(browser.text("#done").await.starts_with("Retried 1 row"));
    let now = browser.text(warning).await;
    assert!(
        now.contains("has 1 parked"),
        "the warning after the retry: {now}"
    );
    browser.screenshot("parked-after-retry").await;
    browser.client.goto(&served.url("/")).await.unwrap();
    assert_eq!(browser.text(parked).await, "1");
    browser.close().await;
}
