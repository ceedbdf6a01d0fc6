//! The broker's queues on the overview (RabbitMQ, the machine's node): each group's shard
//! queues with what they hold, a missing one called out, and a broker that cannot be reached
//! said so without the rest of the page failing.

use outbox_runtime::console::ConsoleSettings;
use outbox_runtime::rabbitmq::RabbitMq;
use outbox_tests::browser::{Browser, Served};
use outbox_tests::rabbitmq::{delete_exchange, delete_queue, publish_raw, unique_name, SHARED_URL};
use outbox_tests::TestDb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_shows_each_groups_rabbitmq_queues() {
    let db = TestDb::new().await;
    let topic = unique_name("console.events");
    let group = unique_name("billing");
    let rabbitmq = RabbitMq::new(SHARED_URL).shards(2);
    rabbitmq.ensure_topology(&topic, &group).await.unwrap();
    for n in 0..3 {
        publish_raw(
            SHARED_URL,
            &topic,
            "1",
            &[],
            format!("{{\"n\":{n}}}").as_bytes(),
        )
        .await;
    }
    // A second group whose queues nobody declared.
    let absent = unique_name("audit");
    let served = Served::start(
        &db.pool,
        ConsoleSettings::default()
            .rabbitmq_queues(rabbitmq, [group.clone(), absent.clone()])
            .rabbitmq_topics([topic.clone()]),
    )
    .await;
    let browser = Browser::start().await;
    browser.client.goto(&served.url("/")).await.unwrap();

    let cell =
        |queue: &str, column: &str| format!("#broker-queues tr[data-queue='{queue}'] td.{column}");
    let shard = |n: u16| format!("{topic}.{group}.{n}");
    assert_eq!(browser.text(&cell(&shard(1), "ready")).await, "3");
    assert_eq!(browser.text(&cell(&shard(0), "ready")).await, "0");
    assert_eq!(browser.text(&cell(&shard(1), "state")).await, "no consumer");
    assert_eq!(
        browser
            .text(&cell(&format!("{}.retry", shard(0)), "state"))
            .await,
        "ok"
    );
    let missing = format!("{topic}.{absent}.0");
    assert_eq!(browser.text(&cell(&missing, "state")).await, "missing");
    assert_eq!(browser.text(&cell(&missing, "ready")).await, "-");
    // Both groups: 2 shard queues, 2 delay queues and the dead letters each.
    assert_eq!(browser.count("#broker-queues tbody tr").await, 10);
    let title = browser.text("main").await;
    assert!(
        title.contains("RabbitMQ at amqp://guest:***@127.0.0.1:5672"),
        "{title}"
    );
    browser
        .eval("document.getElementById('broker-queues').scrollIntoView()")
        .await;
    browser.screenshot("overview-rabbitmq-queues").await;
    browser.close().await;

    for n in 0..2 {
        delete_queue(SHARED_URL, &shard(n)).await;
        delete_queue(SHARED_URL, &format!("{}.retry", shard(n))).await;
    }
    delete_queue(SHARED_URL, &format!("{topic}.dlq")).await;
    delete_exchange(SHARED_URL, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_cannot_be_reached_is_said_so_and_the_rest_of_the_page_stands() {
    let db = TestDb::new().await;
    // A port nothing listens on.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let served = Served::start(
        &db.pool,
        ConsoleSettings::default()
            .rabbitmq_queues(
                RabbitMq::new(format!("amqp://guest:guest@127.0.0.1:{port}")),
                ["billing"],
            )
            .rabbitmq_topics(["order.events"]),
    )
    .await;
    let browser = Browser::start().await;
    browser.client.goto(&served.url("/")).await.unwrap();
    let error = browser.text("#broker-queues-error").await;
    assert!(error.contains("could not be read"), "{error}");
    assert!(error.contains(&format!("127.0.0.1:{port}")), "{error}");
    assert!(browser.count("#outbox-topics, p.empty").await >= 1);
    browser.close().await;
}

#[tokio::test]
async fn queues_without_a_group_are_refused() {
    let err = outbox_runtime::console::router(
        sqlx::PgPool::connect_lazy("postgres://127.0.0.1/none").unwrap(),
        ConsoleSettings::default().rabbitmq_queues(RabbitMq::new(SHARED_URL), Vec::<String>::new()),
    )
    .expect_err("refused");
    assert!(err.to_string().contains("consumer group"), "{err}");
}
