//! The RabbitMQ fixture itself: a node of a test's own reads back what was published, in order;
//! killed (SIGKILL) and started again it still holds a durable queue's persistent messages;
//! and the helpers work the same against the shared node.

use std::time::{Duration, Instant};

use outbox_tests::kafka::Outgoing;
use outbox_tests::rabbitmq::{self, RabbitNode, SHARED_URL};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_its_own_reads_back_in_order_and_keeps_durable_queues_across_a_kill() {
    let started = Instant::now();
    let mut node = RabbitNode::start().await;
    eprintln!(
        "node {} started in {:?}",
        node.node_name(),
        started.elapsed()
    );
    let url = node.url();

    // Through the default exchange (routing by queue name), read back in order.
    let queue = rabbitmq::unique_name("fixture");
    rabbitmq::declare_queue_bound(&url, &queue, "", &queue).await;
    for i in 0..3 {
        let key = format!("k{i}");
        let body = format!("{{\"n\":{i}}}");
        rabbitmq::publish_raw(
            &url,
            "",
            &queue,
            &[
                ("outbox_key", &key),
                ("outbox_timestamp_ms", "1700000000000"),
            ],
            body.as_bytes(),
        )
        .await;
    }
    let read = rabbitmq::read_queue(&url, &queue, 3, Duration::from_secs(10)).await;
    assert_eq!(read.len(), 3, "{read:?}");
    for (i, r) in read.iter().enumerate() {
        assert_eq!(r.key, format!("k{i}"));
        assert_eq!(r.payload["n"], i);
        assert_eq!(r.offset, i as i64);
        assert_eq!(r.partition, 0, "a queue name is not a shard");
        assert_eq!(r.timestamp_ms, Some(1_700_000_000_000));
    }
    assert_eq!(
        rabbitmq::queue_depth(&url, &queue).await,
        Some(0),
        "read = taken"
    );

    // Through an exchange, by a shard's routing key: the partition.
    let exchange = rabbitmq::unique_name("fixture-x");
    let sharded = rabbitmq::unique_name("fixture-shard");
    rabbitmq::declare_queue_bound(&url, &sharded, &exchange, "2").await;
    let records: Vec<Outgoing> = (0..2)
        .map(|i| Outgoing {
            key: format!("s{i}"),
            payload: b"not json".to_vec(),
            headers: vec![("event_type".into(), "Sharded".into())],
        })
        .collect();
    rabbitmq::publish(&url, &exchange, "2", &records).await;
    let read = rabbitmq::read_queue(&url, &sharded, 2, Duration::from_secs(10)).await;
    assert_eq!(read.len(), 2, "{read:?}");
    assert_eq!((read[0].key.as_str(), read[1].key.as_str()), ("s0", "s1"));
    assert!(read
        .iter()
        .all(|r| r.partition == 2 && r.header("event_type") == "Sharded"));
    assert_eq!(read[0].payload, serde_json::Value::Null);
    assert_eq!(read[0].raw, b"not json");

    // Persistent messages on a durable queue, committed: stored. A SIGKILL, a restart.
    let durable = rabbitmq::unique_name("fixture-durable");
    rabbitmq::declare_queue_bound(&url, &durable, "", &durable).await;
    for i in 0..3 {
        rabbitmq::publish_raw(
            &url,
            "",
            &durable,
            &[("outbox_key", &format!("d{i}"))],
            b"{}",
        )
        .await;
    }
    assert_eq!(rabbitmq::queue_depth(&url, &durable).await, Some(3));
    let pid = node.pid().expect("running");
    node.kill();
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the Erlang VM is gone"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", node.port())).is_err(),
        "nothing answers on the node's port once killed"
    );
    let restarted = Instant::now();
    node.spawn().await;
    eprintln!("node restarted in {:?}", restarted.elapsed());
    let depth = rabbitmq::queue_depth(&url, &durable).await;
    assert_eq!(depth, Some(3), "after the restart\n{}", node.log_tail());
    let read = rabbitmq::read_queue(&url, &durable, 3, Duration::from_secs(10)).await;
    let keys: Vec<&str> = read.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys, ["d0", "d1", "d2"], "{}", node.log_tail());

    assert_eq!(
        rabbitmq::queue_depth(&url, &rabbitmq::unique_name("missing")).await,
        None
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_queue_returns_what_publish_raw_sent_on_the_shared_node() {
    let exchange = rabbitmq::unique_name("fixture-x");
    let queue = rabbitmq::unique_name("fixture");
    rabbitmq::declare_queue_bound(SHARED_URL, &queue, &exchange, "3").await;
    assert_eq!(rabbitmq::queue_depth(SHARED_URL, &queue).await, Some(0));
    rabbitmq::publish_raw(
        SHARED_URL,
        &exchange,
        "3",
        &[
            ("outbox_key", "order-7"),
            ("outbox_timestamp_ms", "1700000000123"),
            ("event_type", "PaymentSucceeded"),
        ],
        br#"{"order_id":7}"#,
    )
    .await;
    // Another routing key: not bound, dropped.
    rabbitmq::publish_raw(SHARED_URL, &exchange, "4", &[], b"{}").await;
    assert_eq!(rabbitmq::queue_depth(SHARED_URL, &queue).await, Some(1));

    let read = rabbitmq::read_queue(SHARED_URL, &queue, 2, Duration::from_secs(1)).await;
    assert_eq!(read.len(), 1, "{read:?}");
    let r = &read[0];
    assert_eq!(r.key, "order-7");
    assert_eq!(r.payload, serde_json::json!({"order_id": 7}));
    assert_eq!(r.raw, br#"{"order_id":7}"#);
    assert_eq!(r.header("event_type"), "PaymentSucceeded");
    assert_eq!(r.timestamp_ms, Some(1_700_000_000_123));
    assert_eq!((r.partition, r.offset), (3, 0));

    // A queue that appears while read_queue waits for it.
    let late = rabbitmq::unique_name("fixture-late");
    let reader = tokio::spawn({
        let late = late.clone();
        async move { rabbitmq::read_queue(SHARED_URL, &late, 1, Duration::from_secs(10)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    rabbitmq::declare_queue_bound(SHARED_URL, &late, "", &late).await;
    rabbitmq::publish_raw(SHARED_URL, "", &late, &[("outbox_key", "late")], b"1").await;
    let read = reader.await.unwrap();
    assert_eq!(read.len(), 1);
    assert_eq!(read[0].key, "late");
    assert_eq!(read[0].payload, serde_json::json!(1));

    rabbitmq::delete_queue(SHARED_URL, &queue).await;
    rabbitmq::delete_queue(SHARED_URL, &late).await;
    rabbitmq::delete_exchange(SHARED_URL, &exchange).await;
    assert_eq!(rabbitmq::queue_depth(SHARED_URL, &queue).await, None);
}
