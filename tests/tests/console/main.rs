//! The operator console in headless Chromium, against the real database and the mock Kafka
//! cluster: the overview's figures against the tables, retrying a parked row and a dead inbox
//! row from the pages, finding an event, the relays page, pagination, and who may act; then,
//! a module each, what an operator met in the browser (issue 35): the weight of a page of
//! large payloads (`weight.rs`), every page at 1400 and 1024 pixels (`layout.rs`), the
//! charts of a fresh console (`charts.rs`), the page after an action (`after_action.rs`), the
//! words (`words.rs`), the vacuum warning of a fresh installation (`vacuum.rs`), a record
//! too large for the broker (`too_large.rs`); and RabbitMQ's queues on the overview
//! (`queues.rs`). Screenshots of the pages go to
//! `target/console-screenshots/`.

mod after_action;
mod charts;
mod layout;
mod queues;
mod too_large;
mod vacuum;
mod weight;
mod words;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fantoccini::Locator;
use outbox_runtime::admin;
use outbox_runtime::console::{self, ConsoleSettings};
use outbox_runtime::inbox::{HandlerError, Mode};
use outbox_runtime::{inbox_handler, Uow};
use outbox_tests::browser::{Browser, Served, TOKEN};
use outbox_tests::deposits::{deposit, relay_on, PARTITIONS, TOPIC};
use outbox_tests::fixtures::PaymentSucceeded;
use outbox_tests::kafka::{consume, Kafka};
use outbox_tests::payments::{self, wait_for};
use outbox_tests::{count, Running, TestDb};
use rdkafka::types::RDKafkaRespErr;
use sqlx::PgPool;

/// Parks `n` rows of `topic` as a relay would have (refused too often), oldest first.
pub(crate) async fn park(pool: &PgPool, topic: &str, n: i64) {
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key, attempts, last_error, parked_at) \
         SELECT gen_random_uuid(), 'Account', i::text, 'Deposited', \
                jsonb_build_object('seq', i, 'note', repeat('n', 300)), $1, 'acct-' || i, 3, \
                'Broker: Policy violation', now() \
         FROM generate_series(1, $2) AS i",
    )
    .bind(topic)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

pub(crate) fn with_actions() -> ConsoleSettings {
    ConsoleSettings::default()
        .allow_actions(TOKEN)
        .sample_interval(Duration::from_secs(1))
        .refresh_interval(Duration::from_secs(1))
}

/// Accepts the confirmation dialog the last click opened; returns its question.
pub(crate) async fn confirm_dialog(browser: &Browser) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(text) = browser.client.get_alert_text().await {
            browser.client.accept_alert().await.expect("accept");
            return text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no confirmation dialog"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_shows_the_tables_figures_and_follows_them() {
    let db = TestDb::new().await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    for seq in 0..5 {
        uow.emit(&deposit(1, seq)).await.unwrap();
    }
    uow.commit().await.unwrap();
    park(&db.pool, "audit.events", 2).await;
    sqlx::query(
        "INSERT INTO inbox_event (event_id, payload, topic, event_type, attempts, last_error, dead_at) \
         SELECT gen_random_uuid(), '{}', 'payment.events', 'PaymentSucceeded', \
                CASE WHEN i = 1 THEN 5 ELSE 0 END, CASE WHEN i = 1 THEN 'boom' END, \
                CASE WHEN i = 1 THEN now() END \
         FROM generate_series(1, 4) AS i",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // A read-only console.
    let served = Served::start(
        &db.pool,
        ConsoleSettings::default()
            .sample_interval(Duration::from_secs(1))
            .refresh_interval(Duration::from_secs(1)),
    )
    .await;
    let browser = Browser::start().await;
    browser.client.goto(&served.url("/")).await.unwrap();

    let status = admin::status(&db.pool).await.unwrap();
    let cell =
        |topic: &str, column: &str| format!("#outbox-topics tr[data-topic='{topic}'] td.{column}");
    let deposits = status.outbox.iter().find(|t| t.topic == TOPIC).unwrap();
    assert_eq!(
        browser.text(&cell(TOPIC, "unpublished")).await,
        deposits.unpublished.to_string()
    );
    assert_eq!(deposits.unpublished, 5);
    assert_eq!(browser.text(&cell("audit.events", "parked")).await, "2");
    assert_eq!(
        browser.text(&cell("audit.events", "unpublished")).await,
        "0"
    );
    let inbox = |column: &str| format!("#inbox-topics tr[data-topic='payment.events'] td.{column}");
    assert_eq!(browser.text(&inbox("unprocessed")).await, "3");
    assert_eq!(browser.text(&inbox("dead")).await, "1");
    // The warnings name the parked and dead rows.
    assert_eq!(browser.count("#warnings li[data-kind='parked']").await, 1);
    assert_eq!(
        browser.count("#warnings li[data-kind='dead_inbox']").await,
        1
    );

    // The figures follow the tables without a reload, and the charts appear once sampled.
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    for seq in 5..12 {
        uow.emit(&deposit(1, seq)).await.unwrap();
    }
    uow.commit().await.unwrap();
    browser
        .wait_for_text(&cell(TOPIC, "unpublished"), Duration::from_secs(20), |t| {
            t == "12"
        })
        .await;
    // The backlog chart draws its two series once it has two samples.
    browser
        .wait_for_count("figure.chart.backlog svg path", 2, Duration::from_secs(20))
        .await;
    browser.screenshot("overview").await;

    // Read-only: no page offers an action, and the server refuses one.
    browser.client.goto(&served.url("/parked")).await.unwrap();
    assert_eq!(browser.text("#count").await, "2 rows match");
    assert_eq!(browser.count("button[formaction]").await, 0);
    assert_eq!(browser.count("a[href='/login']").await, 0);
    let (code, body) = served
        .request(
            "POST",
            "/parked/retry",
            &[("Authorization", &format!("Bearer {TOKEN}"))],
            "id=1&confirmed=1",
        )
        .await;
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("read-only"), "{body}");
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM outbox_event WHERE parked_at IS NOT NULL"
        )
        .await,
        2
    );
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_row_retried_from_the_page_is_published() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    let id = uow.emit(&deposit(1, 0)).await.unwrap();
    uow.commit().await.unwrap();
    kafka.fail_produce_requests(&[RDKafkaRespErr::RD_KAFKA_RESP_ERR_POLICY_VIOLATION; 10]);
    let relay = relay_on(&db.pool, &kafka).max_attempts(2).build().unwrap();
    let running = Running::relay(&relay);
    wait_for("parked", Duration::from_secs(30), || async {
        relay.status().await.unwrap().parked == 1
    })
    .await;
    let outbox_id: i64 = sqlx::query_scalar("SELECT id FROM outbox_event WHERE event_id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    kafka.clear_produce_errors();

    let served = Served::start(&db.pool, with_actions()).await;
    let browser = Browser::start().await;
    // Not signed in: the row, and no action.
    browser.client.goto(&served.url("/parked")).await.unwrap();
    assert!(browser
        .text(&format!("tr[data-id='{outbox_id}'] td.error"))
        .await
        .contains("olicy"));
    assert_eq!(browser.count("button[formaction]").await, 0);
    browser.sign_in(&served, TOKEN).await;
    browser.client.goto(&served.url("/parked")).await.unwrap();
    browser.screenshot("parked").await;
    browser
        .client
        .find(Locator::Css(&format!(
            "tr[data-id='{outbox_id}'] button.act-retried"
        )))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let question = confirm_dialog(&browser).await;
    assert!(question.starts_with("Retry 1 parked event"), "{question}");
    assert_eq!(browser.text("#done").await, "Retried 1 row.");

    // The row is un-parked in PostgreSQL, published by the running relay, and on the broker.
    wait_for("published", Duration::from_secs(30), || async {
        count(
            &db.pool,
            "SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL AND parked_at IS NULL",
        )
        .await
            == 1
    })
    .await;
    let received = consume(
        &kafka.bootstrap(),
        TOPIC,
        PARTITIONS,
        Duration::from_secs(30),
        |r| !r.is_empty(),
    )
    .await;
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].outbox_id(), outbox_id);
    assert_eq!(received[0].header("event_id"), id.to_string());
    browser.client.goto(&served.url("/parked")).await.unwrap();
    assert_eq!(browser.text("#count").await, "0 rows match");
    browser.close().await;
    running.stop().await;
}

/// Refuses while set: the dead-row test's handler.
static REFUSE: AtomicBool = AtomicBool::new(true);

#[inbox_handler]
async fn mark_paid_unless_refused(
    event: PaymentSucceeded,
    tx: &mut sqlx::PgConnection,
) -> Result<(), HandlerError> {
    if REFUSE.load(Ordering::SeqCst) {
        return Err(HandlerError::permanent("refused by the test's switch"));
    }
    sqlx::query("UPDATE orders SET payment_status = 'paid', paid = paid + 1 WHERE id = $1")
        .bind(event.order_id)
        .execute(tx)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_inbox_row_retried_from_the_page_is_handled_and_found_by_id() {
    let (db, kafka) = payments::setup().await;
    let orders = payments::orders_with_payments(&db.pool, 1).await;
    let consumer = payments::builder(&db, &kafka, "orders")
        .handler(mark_paid_unless_refused)
        .mode(Mode::Inbox)
        .poll_interval(Duration::from_millis(50))
        .build()
        .unwrap();
    let running = Running::consumer(&consumer);
    payments::publish(&kafka, &orders).await;
    wait_for("dead", Duration::from_secs(30), || async {
        consumer.inbox_status().await.unwrap().dead == 1
    })
    .await;
    let event_id = orders[0].0;
    REFUSE.store(false, Ordering::SeqCst);

    let served = Served::start(&db.pool, with_actions()).await;
    let browser = Browser::start().await;
    browser.sign_in(&served, TOKEN).await;
    browser.client.goto(&served.url("/dead")).await.unwrap();
    assert!(browser
        .text(&format!("tr[data-id='{event_id}'] td.error"))
        .await
        .contains("refused by the test's switch"));
    browser.screenshot("dead").await;
    browser
        .client
        .find(Locator::Css(&format!(
            "tr[data-id='{event_id}'] button.act-retried"
        )))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let question = confirm_dialog(&browser).await;
    assert!(question.starts_with("Retry 1 dead inbox row"), "{question}");
    assert_eq!(browser.text("#done").await, "Retried 1 row.");
    wait_for("handled", Duration::from_secs(30), || async {
        count(
            &db.pool,
            "SELECT count(*) FROM orders WHERE payment_status = 'paid' AND paid = 1",
        )
        .await
            == 1
    })
    .await;

    // Find it by id from the search box of the page's header.
    let search = browser
        .client
        .find(Locator::Css("form.find input"))
        .await
        .unwrap();
    search.send_keys(&event_id.to_string()).await.unwrap();
    search.send_keys("\u{E007}").await.unwrap();
    let state = browser.text("#inbox-state").await;
    assert!(state.starts_with("Inbox: processed at"), "{state}");
    assert_eq!(
        browser.count("#outbox-row").await,
        0,
        "this database did not emit it"
    );
    browser.screenshot("event").await;
    browser.close().await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_page_shows_the_instances_their_shards_and_the_held_keys() {
    let db = TestDb::new().await;
    let kafka = Kafka::mock();
    kafka.create_topic(TOPIC, PARTITIONS).await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    uow.emit(&deposit(1, 0)).await.unwrap();
    uow.commit().await.unwrap();
    // A row to a topic that does not exist: held, with the broker's error.
    sqlx::query(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, \
                                   topic, partition_key) \
         VALUES (gen_random_uuid(), 'Account', 'acct-9', 'Audited', '{}', 'missing.topic', 'acct-9')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Two relays, as two processes would run.
    let relay = || {
        let mut config = rdkafka::ClientConfig::new();
        config.set("allow.auto.create.topics", "false");
        relay_on(&db.pool, &kafka)
            .producer_config(config)
            .brokers(kafka.bootstrap())
            .build()
            .unwrap()
    };
    let (relay, other) = (relay(), relay());
    let running = [Running::relay(&relay), Running::relay(&other)];
    wait_for("held", Duration::from_secs(30), || async {
        relay.status().await.unwrap().held == 1
    })
    .await;
    wait_for(
        "both instances own shards",
        Duration::from_secs(30),
        || async {
            let instances = admin::relay_instances(&db.pool).await.unwrap();
            instances.len() == 2 && instances.iter().map(|i| i.shards.len()).sum::<usize>() == 64
        },
    )
    .await;

    let served = Served::start(&db.pool, ConsoleSettings::default()).await;
    let browser = Browser::start().await;
    browser.client.goto(&served.url("/relays")).await.unwrap();
    let instances = admin::relay_instances(&db.pool).await.unwrap();
    assert_eq!(browser.count("#relay-instances tbody tr").await, 2);
    for instance in &instances {
        let row = format!("#relay-instances tr[data-pid='{}']", instance.pid);
        assert_eq!(
            browser.text(&format!("{row} td.shards")).await,
            instance.shards.len().to_string()
        );
    }
    let held = browser
        .text("#held-keys tr[data-topic='missing.topic']")
        .await;
    assert!(held.contains("acct-9"), "{held}");
    let error = admin::held_keys(&db.pool, 10).await.unwrap()[0]
        .last_error
        .clone()
        .unwrap();
    assert!(
        held.contains(&error[..error.len().min(40)]),
        "{held} / {error}"
    );
    browser.screenshot("relays").await;
    browser.close().await;
    for running in running {
        running.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_rows_come_a_page_at_a_time_and_filter_by_topic() {
    let db = TestDb::new().await;
    park(&db.pool, TOPIC, 120).await;
    park(&db.pool, "audit.events", 5).await;
    let served = Served::start(&db.pool, ConsoleSettings::default().page_size(50)).await;
    let browser = Browser::start().await;
    browser
        .client
        .goto(&served.url(&format!("/parked?topic={TOPIC}")))
        .await
        .unwrap();
    assert_eq!(browser.text("#count").await, "120 rows match");
    let mut seen: Vec<i64> = Vec::new();
    let mut pages = Vec::new();
    loop {
        let ids: Vec<i64> = {
            let rows = browser
                .client
                .find_all(Locator::Css("#rows tbody tr"))
                .await
                .unwrap();
            let mut ids = Vec::new();
            for row in rows {
                ids.push(row.attr("data-id").await.unwrap().unwrap().parse().unwrap());
            }
            ids
        };
        pages.push(ids.len());
        seen.extend(ids);
        if browser.count("#next").await == 0 {
            break;
        }
        browser
            .client
            .find(Locator::Css("#next"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        browser.text("#count").await;
    }
    assert_eq!(pages, [50, 50, 20]);
    let expected: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM outbox_event WHERE topic = $1 ORDER BY id")
            .bind(TOPIC)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(seen, expected, "every row once, in order");

    // More rows than the count goes to: it says so instead of counting them all.
    park(&db.pool, "bulk.events", 10_050).await;
    let (code, page) = served
        .request("GET", "/parked?topic=bulk.events", &[], "")
        .await;
    assert_eq!(code, 200);
    assert!(page.contains("10,000+ rows match"), "{page}");
    assert_eq!(page.matches("<tr data-id=").count(), 50);

    // A bad time is a clear error, not a page of something else.
    let (code, body) = served
        .request("GET", "/parked?since=yesterday", &[], "")
        .await;
    assert_eq!(code, 400);
    assert!(
        body.contains("`since`: `yesterday` is not a time"),
        "{body}"
    );
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_needs_the_token_and_this_consoles_own_page() {
    let db = TestDb::new().await;
    park(&db.pool, TOPIC, 1).await;
    let id: i64 = sqlx::query_scalar("SELECT id FROM outbox_event")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let parked = || {
        count(
            &db.pool,
            "SELECT count(*) FROM outbox_event WHERE parked_at IS NOT NULL",
        )
    };
    let served = Served::start(&db.pool, with_actions()).await;
    let body = format!("id={id}&confirmed=1");
    let bearer = format!("Bearer {TOKEN}");

    // No token, a wrong one: refused.
    let (code, page) = served.request("POST", "/parked/retry", &[], &body).await;
    assert_eq!(code, 401, "{page}");
    let (code, _) = served
        .request(
            "POST",
            "/parked/retry",
            &[("Authorization", "Bearer not-the-token-at-all-123")],
            &body,
        )
        .await;
    assert_eq!(code, 401);
    let (code, _) = served
        .request(
            "POST",
            "/parked/retry",
            &[("Cookie", "outbox_console_token=guess-guess-guess-guess")],
            &body,
        )
        .await;
    assert_eq!(code, 401);
    // The token's cookie, sent by another site's form (no anti-forgery field, foreign origin).
    let cookie = format!("outbox_console_token={TOKEN}");
    let (code, page) = served
        .request(
            "POST",
            "/parked/retry",
            &[("Cookie", &cookie), ("Origin", "http://evil.example")],
            &body,
        )
        .await;
    assert_eq!(code, 403, "{page}");
    let (code, _) = served
        .request("POST", "/parked/retry", &[("Cookie", &cookie)], &body)
        .await;
    assert_eq!(code, 403, "a cookie alone, without the form's field");
    let (code, _) = served
        .request(
            "POST",
            "/parked/retry",
            &[("Authorization", &bearer), ("Sec-Fetch-Site", "cross-site")],
            &body,
        )
        .await;
    assert_eq!(code, 403);
    assert_eq!(parked().await, 1, "nothing changed");

    // With the token but unconfirmed: the confirmation page, nothing changed.
    let (code, page) = served
        .request(
            "POST",
            "/parked/retry",
            &[("Authorization", &bearer)],
            &format!("id={id}"),
        )
        .await;
    assert_eq!(code, 200);
    assert!(page.contains("Retry 1 parked event?"), "{page}");
    assert_eq!(parked().await, 1);
    // A selection of nothing, an id that is not one: clear errors.
    let (code, page) = served
        .request(
            "POST",
            "/parked/retry",
            &[("Authorization", &bearer)],
            "confirmed=1",
        )
        .await;
    assert_eq!(code, 400);
    assert!(page.contains("Select at least one row."), "{page}");
    let (code, page) = served
        .request(
            "POST",
            "/parked/skip",
            &[("Authorization", &bearer)],
            "id=x1&confirmed=1",
        )
        .await;
    assert_eq!(code, 400);
    assert!(page.contains("`x1` is not an outbox row id"), "{page}");
    // Confirmed: done, and back to the list.
    let (code, page) = served
        .request(
            "POST",
            "/parked/retry",
            &[("Authorization", &bearer)],
            &body,
        )
        .await;
    assert_eq!(code, 303, "{page}");
    assert!(page.contains("done=retried:1"), "{page}");
    assert_eq!(parked().await, 0);

    // A wrong token at the sign-in page; a token too short for the console.
    let (code, page) = served.request("POST", "/login", &[], "token=wrong").await;
    assert_eq!(code, 401);
    assert!(page.contains("Wrong token."));
    let err = console::router(
        db.pool.clone(),
        ConsoleSettings::default().allow_actions("short"),
    )
    .expect_err("a short token is refused")
    .to_string();
    assert!(err.contains("at least 16 characters"), "{err}");
}

/// The header `name` of a raw response, if it has one.
fn header<'a>(response: &'a str, name: &str) -> Option<&'a str> {
    let head = response.split("\r\n\r\n").next().unwrap_or("");
    head.lines().find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sign_in_returns_only_to_this_console_and_odd_requests_get_clear_pages() {
    let db = TestDb::new().await;
    park(&db.pool, TOPIC, 1).await;
    let id: i64 = sqlx::query_scalar("SELECT id FROM outbox_event")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    // A token given with spaces around it is the token without them.
    let settings = ConsoleSettings::default().allow_actions(format!("  {TOKEN}\n"));
    let served = Served::start(&db.pool, settings).await;

    // After signing in, back to a page of this console only: never to another host, however
    // the address is spelled (a browser reads `\` as `/` and drops tabs).
    for next in [
        "/parked",
        "//evil.example",
        "/%5Cevil.example",
        "/%09/evil.example",
        "https://evil.example/",
        "/%0d%0aX-Evil:%201",
    ] {
        let (code, response) = served
            .request("POST", "/login", &[], &format!("token={TOKEN}&next={next}"))
            .await;
        assert_eq!(code, 303, "{next}: {response}");
        let location = header(&response, "location").unwrap();
        let expected = if next == "/parked" { "/parked" } else { "/" };
        assert_eq!(location, expected, "next={next}");
        assert!(header(&response, "x-evil").is_none());
    }
    // Every page refuses to be framed by another site.
    let (_, response) = served.request("GET", "/", &[], "").await;
    assert_eq!(header(&response, "x-frame-options"), Some("DENY"));

    // A request without a Host header (as HTTP/2 carries it: in the URI): the origin is
    // checked against the request's own authority.
    let bearer = format!("Bearer {TOKEN}");
    let addr = served.addr;
    let body = "token=nope";
    let (code, page) = served
        .raw(&format!(
            "POST http://{addr}/login HTTP/1.1\r\nOrigin: http://{addr}\r\nConnection: close\r\n\
             Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ))
        .await;
    assert_eq!(
        code, 401,
        "checked as from this console, then the token refused: {page}"
    );
    assert!(page.contains("Wrong token."), "{page}");

    // A query that does not parse: a page that says so.
    let (code, page) = served
        .request("GET", "/parked?topic=a&topic=b", &[], "")
        .await;
    assert_eq!(code, 400, "{page}");
    assert!(
        page.contains("<html"),
        "a page of the console, not a bare error: {page}"
    );

    // A list address that is not one: the action is done, and the way back is the list.
    let (code, response) = served
        .request(
            "POST",
            "/parked/retry",
            &[("Authorization", &bearer)],
            &format!("id={id}&confirmed=1&back=topic%3D%01x%0d%0aX-Evil%3A1"),
        )
        .await;
    assert_eq!(code, 303, "{response}");
    let location = header(&response, "location").unwrap();
    assert!(location.starts_with("/parked?"), "{location}");
    assert!(header(&response, "x-evil").is_none());
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM outbox_event WHERE parked_at IS NOT NULL"
        )
        .await,
        0
    );

    // Basic credentials from a proxy are not the token: with the token's cookie, the form's
    // anti-forgery field is still needed.
    park(&db.pool, TOPIC, 1).await;
    let id: i64 = sqlx::query_scalar("SELECT id FROM outbox_event WHERE parked_at IS NOT NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let cookie = format!("outbox_console_token={TOKEN}");
    let (code, _) = served
        .request(
            "POST",
            "/parked/retry",
            &[
                ("Cookie", &cookie),
                ("Authorization", "Basic cHJveHk6cHJveHk="),
            ],
            &format!("id={id}&confirmed=1"),
        )
        .await;
    assert_eq!(code, 403);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_nested_in_an_application_links_within_its_path() {
    let db = TestDb::new().await;
    park(&db.pool, TOPIC, 1).await;
    let nested = |settings: ConsoleSettings| {
        axum::Router::new().nest(
            "/ops/outbox",
            console::router(db.pool.clone(), settings).unwrap(),
        )
    };
    // Nested where its settings say: every link and the cookie stay under its path.
    let served = Served::router(nested(
        ConsoleSettings::default()
            .mounted_at("/ops/outbox/")
            .allow_actions(TOKEN),
    ))
    .await;
    let (code, page) = served.request("GET", "/ops/outbox", &[], "").await;
    assert_eq!(code, 200, "{page}");
    let links: Vec<&str> = page
        .split("href=\"")
        .skip(1)
        .filter_map(|s| s.split('"').next())
        .collect();
    assert!(!links.is_empty());
    for link in &links {
        assert!(
            link.starts_with("/ops/outbox"),
            "a link out of the console: {link} in {links:?}"
        );
    }
    let (code, response) = served
        .request(
            "POST",
            "/ops/outbox/login",
            &[],
            &format!("token={TOKEN}&next=/ops/outbox/parked"),
        )
        .await;
    assert_eq!(code, 303, "{response}");
    assert_eq!(header(&response, "location"), Some("/ops/outbox/parked"));
    let cookie = header(&response, "set-cookie").unwrap();
    assert!(cookie.contains("Path=/ops/outbox;"), "{cookie}");
    // A page of the application beside it is not a page to return to.
    let (_, response) = served
        .request(
            "POST",
            "/ops/outbox/login",
            &[],
            &format!("token={TOKEN}&next=/ops/other"),
        )
        .await;
    assert_eq!(header(&response, "location"), Some("/ops/outbox"));

    // Nested without saying so: a page that says what to set, not links to the wrong place.
    let served = Served::router(nested(ConsoleSettings::default())).await;
    let (code, page) = served.request("GET", "/ops/outbox/parked", &[], "").await;
    assert_eq!(code, 500);
    assert!(
        page.contains("ConsoleSettings::mounted_at(&quot;/ops/outbox&quot;)"),
        "{page}"
    );
    // A path that is not one is refused when the router is built.
    let err = console::router(
        db.pool.clone(),
        ConsoleSettings::default().mounted_at("ops outbox"),
    )
    .expect_err("not a path")
    .to_string();
    assert!(err.contains("mounted_at must be a path"), "{err}");
}
