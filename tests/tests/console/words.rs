//! The words of the pages: a figure's noun agrees with it ("1 parked outbox row", never
//! "row(s)"), and a parked row retried says so on its event page (when, by which action),
//! its last error kept as what happened before the retry.

use fantoccini::Locator;
use outbox_runtime::console::ConsoleSettings;
use outbox_tests::browser::{Browser, Served, TOKEN};
use outbox_tests::TestDb;

use super::{confirm_dialog, park};

/// The page's text has no "(s)" and no "1 <noun>s".
async fn agrees(browser: &Browser, page: &str) {
    let text = browser.text("body").await;
    assert!(!text.contains("(s)"), "{page}: {text}");
    for plural in [
        " rows",
        " events",
        " attempts",
        " instances",
        " warnings",
        " keys",
    ] {
        let one = format!(" 1{plural}");
        let at = text.find(&one);
        assert!(at.is_none(), "{page}: `{one}` in {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn figures_agree_with_their_nouns_and_a_retried_row_says_it_was() {
    let db = TestDb::new().await;
    park(&db.pool, "audit.events", 1).await;
    let id: i64 = sqlx::query_scalar("SELECT id FROM outbox_event")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let served = Served::start(&db.pool, ConsoleSettings::default().allow_actions(TOKEN)).await;
    let browser = Browser::start().await;
    browser.sign_in(&served, TOKEN).await;

    browser.client.goto(&served.url("/parked")).await.unwrap();
    let warning = browser.text("#warnings li[data-kind='parked']").await;
    assert!(
        warning.contains("`audit.events` has 1 parked outbox row "),
        "{warning}"
    );
    agrees(&browser, "parked").await;
    browser.client.goto(&served.url("/")).await.unwrap();
    browser.text("#outbox-topics").await;
    agrees(&browser, "overview").await;
    browser
        .client
        .goto(&served.url(&format!("/event?id={id}")))
        .await
        .unwrap();
    browser.text("#outbox-state").await;
    agrees(&browser, "the parked row's event page").await;

    // Retried from the list: the event page says so, and keeps the error as history.
    browser.client.goto(&served.url("/parked")).await.unwrap();
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
    let question = confirm_dialog(&browser).await;
    assert!(!question.contains("(s)"), "{question}");
    let done = browser.text("#done").await;
    assert_eq!(done, "Retried 1 row.");
    agrees(&browser, "the list after the retry").await;
    browser
        .client
        .goto(&served.url(&format!("/event?id={id}")))
        .await
        .unwrap();
    let state = browser.text("#outbox-state").await;
    assert!(
        state.contains("Retried at") && state.contains("Retry in the console"),
        "{state}"
    );
    assert!(!state.contains("0 refused"), "{state}");
    let row = browser.text("#outbox-row").await;
    assert!(
        row.contains("Last error (before the retry)") && row.contains("Broker: Policy violation"),
        "{row}"
    );
    agrees(&browser, "the retried row's event page").await;
    browser.screenshot("event-after-retry").await;
    browser.close().await;
}
