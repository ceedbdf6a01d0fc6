//! Every page at 1400 and at 1024 CSS pixels, with the long values operators meet (topics,
//! keys, event types, errors, some without a space to break at): no page scrolls sideways, a
//! list's long values are cut to one line with the whole value on hover (its `title`) and on
//! the event page, and its columns stay readable at 1024. A screenshot of every page at both
//! widths goes to `target/console-screenshots/<page>-<width>.png`.

use fantoccini::Locator;
use outbox_runtime::console::ConsoleSettings;
use outbox_tests::browser::{Browser, Served, TOKEN};
use outbox_tests::TestDb;
use sqlx::PgPool;

const TOPIC: &str = "payments.settlement.reconciliation.events.v2";
const LONG_KEY: &str = "customer-7f3a9c2e-5b1d-4e8a-9f6c-0d2b7e4a1c93/invoice-2026-12-000004711/\
                        line-items/batch-0042";
const TYPE: &str = "InvoiceLineItemsReconciliationRequested";
const ERROR: &str = "Message production error: MessageSizeTooLarge (Broker: Message size too \
                     large): the broker refused a record of 1,152,021 bytes; the topic's \
                     max.message.bytes or the broker's message.max.bytes is lower, and the \
                     producer allows 1,000,000 bytes";
const URL_ERROR: &str = "schema-registry:https://schema-registry.internal.example:8081/subjects/\
                         payments-settlement-reconciliation-events-v2-value/versions/latest/\
                         compatibility-check-failed-for-field-lineItems[42].amount.currency";

/// Parked rows with short keys (`doc-1`...), one with a long key and an error without spaces;
/// dead rows alike; and a held key, for the relays page.
async fn fill(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key, attempts, last_error, parked_at) \
         SELECT gen_random_uuid(), 'Invoice', i::text, $2, \
                jsonb_build_object('seq', i, 'lines', repeat('line item, ', 40)), $1, \
                CASE WHEN i = 3 THEN $3 ELSE 'doc-' || i END, 3, \
                CASE WHEN i = 4 THEN $5 ELSE $4 END, now() \
         FROM generate_series(1, 12) AS i",
    )
    .bind(TOPIC)
    .bind(TYPE)
    .bind(LONG_KEY)
    .bind(ERROR)
    .bind(URL_ERROR)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO inbox_event (event_id, payload, topic, event_type, partition_key, attempts, \
                                  last_error, dead_at) \
         SELECT gen_random_uuid(), jsonb_build_object('seq', i), $1, $2, \
                CASE WHEN i = 3 THEN $3 ELSE 'doc-' || i END, 5, $4, now() \
         FROM generate_series(1, 12) AS i",
    )
    .bind(TOPIC)
    .bind(TYPE)
    .bind(LONG_KEY)
    .bind(URL_ERROR)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key, last_error, held_at, next_attempt_at) \
         VALUES (gen_random_uuid(), 'Invoice', '9', $2, '{}', 'missing.' || $1, $3, $4, now(), \
                 now() + interval '1 hour')",
    )
    .bind(TOPIC)
    .bind(TYPE)
    .bind(LONG_KEY)
    .bind(URL_ERROR)
    .execute(pool)
    .await
    .unwrap();
}

const WIDTHS: [u32; 2] = [1400, 1024];

/// At each width: no sideways scroll, and a screenshot `<name>-<width>`.
async fn fits(browser: &Browser, name: &str) {
    for width in WIDTHS {
        assert_eq!(browser.set_viewport(width, 1000).await, width);
        let (over, past) = browser.horizontal_overflow().await;
        assert_eq!(
            over, 0,
            "{name} at {width} px scrolls sideways by {over} px; past the edge: {past:#?}"
        );
        browser.screenshot(&format!("{name}-{width}")).await;
    }
}

/// For every cell of `column` in the list: how many lines its text takes, its `title`, its
/// text and its width.
async fn cells(browser: &Browser, column: &str) -> Vec<(u64, String, String, f64)> {
    let found = browser
        .eval(&format!(
            "return [...document.querySelectorAll('#rows tbody td.{column}')].map(cell => {{
               const range = document.createRange();
               range.selectNodeContents(cell);
               const lines = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
               return [lines.size, cell.title, cell.textContent.trim(),
                       cell.getBoundingClientRect().width];
             }});"
        ))
        .await;
    found
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c[0].as_u64().unwrap(),
                c[1].as_str().unwrap().to_owned(),
                c[2].as_str().unwrap().to_owned(),
                c[3].as_f64().unwrap(),
            )
        })
        .collect()
}

/// Each long value of a list is on one line, whole in its `title`, and readable at 1024.
async fn one_line_each(browser: &Browser, page: &str) {
    for width in WIDTHS {
        browser.set_viewport(width, 1000).await;
        for (column, long) in [
            ("key", LONG_KEY),
            ("topic", TOPIC),
            ("type", TYPE),
            ("error", URL_ERROR),
        ] {
            let cells = cells(browser, column).await;
            assert!(!cells.is_empty(), "{page}: no td.{column}");
            for (lines, title, text, cell_width) in &cells {
                assert_eq!(
                    *lines, 1,
                    "{page} at {width} px: td.{column} `{text}` takes {lines} lines"
                );
                assert_eq!(title, text, "{page}: td.{column}'s whole value on hover");
                assert!(
                    *cell_width >= 70.0,
                    "{page} at {width} px: td.{column} is {cell_width} px wide"
                );
            }
            assert!(
                cells.iter().any(|(_, title, _, _)| title == long),
                "{page}: td.{column} has `{long}` whole in a title"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_fits_1400_and_1024_pixels_with_long_values_cut_to_one_line() {
    let db = TestDb::new().await;
    fill(&db.pool).await;
    let served = Served::start(&db.pool, ConsoleSettings::default().allow_actions(TOKEN)).await;
    let browser = Browser::start().await;
    browser.client.goto(&served.url("/login")).await.unwrap();
    fits(&browser, "login").await;
    browser.sign_in(&served, TOKEN).await;

    browser.client.goto(&served.url("/")).await.unwrap();
    browser.text("#outbox-topics").await;
    fits(&browser, "overview").await;

    browser.client.goto(&served.url("/relays")).await.unwrap();
    browser.text("#held-keys").await;
    fits(&browser, "relays").await;

    browser.client.goto(&served.url("/parked")).await.unwrap();
    browser.text("#rows").await;
    one_line_each(&browser, "parked").await;
    fits(&browser, "parked").await;

    browser.client.goto(&served.url("/dead")).await.unwrap();
    browser.text("#rows").await;
    one_line_each(&browser, "dead").await;
    fits(&browser, "dead").await;

    // The event page has every long value whole.
    let id: i64 = sqlx::query_scalar(
        "SELECT id FROM outbox_event WHERE partition_key = $1 AND parked_at IS NOT NULL",
    )
    .bind(LONG_KEY)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    browser
        .client
        .goto(&served.url(&format!("/event?id={id}")))
        .await
        .unwrap();
    let row = browser.text("#outbox-row").await;
    for whole in [LONG_KEY, TOPIC, TYPE, ERROR] {
        assert!(
            row.contains(whole),
            "the event page has `{whole}` whole: {row}"
        );
    }
    fits(&browser, "event").await;

    // The confirmation, as a browser without JavaScript's dialogs reaches it.
    browser.client.goto(&served.url("/parked")).await.unwrap();
    for check in browser
        .client
        .find_all(Locator::Css("#rows tbody input[name=id]"))
        .await
        .unwrap()
        .into_iter()
        .take(4)
    {
        check.click().await.unwrap();
    }
    browser
        .eval("document.getElementById('selection').submit(); return null;")
        .await;
    browser.text("p.question").await;
    fits(&browser, "confirm").await;

    browser
        .client
        .goto(&served.url("/no/such/page"))
        .await
        .unwrap();
    browser.text("#message").await;
    fits(&browser, "not-found").await;
    browser.close().await;
}
