//! What reads the soak's events back off the broker, into [`Received`]: the Kafka topic, the
//! JetStream stream, or RabbitMQ's shard queues.

use std::collections::HashMap;
use std::time::Duration;

use amqprs::channel::{BasicAckArguments, BasicConsumeArguments, BasicQosArguments, Channel};
use amqprs::connection::{Connection, OpenConnectionArguments};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use super::{Received, PARTITIONS, STREAM, TOPIC};

/// Reads the topic from the beginning into `received`; returns how many offsets it found
/// missing (the mock cluster dropped them from its log before they were read), which would
/// make the check meaningless.
pub(super) async fn consumer(
    bootstrap: String,
    received: Received,
    cancel: CancellationToken,
) -> u64 {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("group.id", format!("soak-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("consumer");
    let mut next_offset: HashMap<i32, i64> = HashMap::new();
    let mut skipped = 0u64;
    let mut assignment = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        assignment
            .add_partition_offset(TOPIC, p, Offset::Beginning)
            .expect("partition");
    }
    consumer.assign(&assignment).expect("assign");
    loop {
        let message = tokio::select! {
            () = cancel.cancelled() => return skipped,
            m = consumer.recv() => m,
        };
        let Ok(message) = message else {
            continue;
        };
        let expected = next_offset.entry(message.partition()).or_insert(0);
        if message.offset() > *expected {
            skipped += (message.offset() - *expected) as u64;
            eprintln!(
                "the consumer found offsets {}..{} of partition {} gone",
                *expected,
                message.offset(),
                message.partition()
            );
        }
        *expected = message.offset() + 1;
        let key = String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned();
        let payload: serde_json::Value =
            serde_json::from_slice(message.payload().unwrap_or_default()).unwrap_or_default();
        if payload["seq"].as_u64().is_none() {
            eprintln!(
                "unreadable record at {}:{}: key {key}, {} bytes",
                message.partition(),
                message.offset(),
                message.payload().map_or(0, <[u8]>::len)
            );
        }
        if let Some(seq) = payload["seq"].as_u64() {
            use rdkafka::message::Headers;
            let outbox_id = message
                .headers()
                .and_then(|h| h.iter().find(|h| h.key == "outbox_id"))
                .and_then(|h| h.value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default();
            let at = (message.partition(), message.offset(), outbox_id);
            received.lock().unwrap().push(((key, seq), at));
        }
    }
}

/// Reads the stream from its first message into `received`, one sequence after another,
/// waiting while the server is away; returns how many sequences it found missing (none can
/// be: nothing limits the stream).
pub(super) async fn stream_reader(
    server_url: String,
    received: Received,
    cancel: CancellationToken,
) -> u64 {
    let client = outbox_runtime::async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(server_url)
        .await
        .expect("nats");
    let js = outbox_runtime::async_nats::jetstream::new(client);
    let mut next = 1u64;
    let mut skipped = 0u64;
    while !cancel.is_cancelled() {
        let stream = match js.get_stream(STREAM).await {
            Ok(stream) => stream,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        loop {
            if cancel.is_cancelled() {
                return skipped;
            }
            match stream.get_raw_message(next).await {
                Ok(message) => {
                    let header = |name: &str| {
                        message
                            .headers
                            .get(name)
                            .map(|v| v.as_str().to_owned())
                            .unwrap_or_default()
                    };
                    let payload: serde_json::Value =
                        serde_json::from_slice(&message.payload).unwrap_or_default();
                    if let Some(seq) = payload["seq"].as_u64() {
                        let at = (0, message.sequence as i64, header("outbox_id"));
                        received
                            .lock()
                            .unwrap()
                            .push(((header("outbox_key"), seq), at));
                    } else {
                        eprintln!("unreadable message at sequence {next}");
                    }
                    if message.sequence > next {
                        skipped += message.sequence - next;
                    }
                    next = message.sequence + 1;
                }
                // Not there yet, or the server is away: look again shortly.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    if js.get_stream(STREAM).await.is_err() {
                        break;
                    }
                }
            }
        }
    }
    skipped
}

/// Reads every shard queue (`queues`, the n-th bound for shard n) into `received`, each
/// message acknowledged once recorded, one reader per queue (so each queue's order is kept);
/// connects again while the node is away (what was not acknowledged comes again: a duplicate,
/// never a loss). Returns 0: a queue drops nothing.
pub(super) async fn queue_reader(
    port: u16,
    queues: Vec<String>,
    received: Received,
    cancel: CancellationToken,
) -> u64 {
    let args = OpenConnectionArguments::new("127.0.0.1", port, "guest", "guest");
    while !cancel.is_cancelled() {
        let connection =
            match tokio::time::timeout(Duration::from_secs(5), Connection::open(&args)).await {
                Ok(Ok(connection)) => connection,
                _ => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
        let mut readers = tokio::task::JoinSet::new();
        for (shard, queue) in queues.iter().enumerate() {
            match subscribe(&connection, queue).await {
                Some((channel, deliveries)) => {
                    readers.spawn(read_queue(channel, deliveries, shard, received.clone()));
                }
                None => break,
            }
        }
        if readers.len() == queues.len() {
            // Until one reader's channel closes (the node went away), or the end.
            tokio::select! {
                () = cancel.cancelled() => {}
                _ = readers.join_next() => {}
            }
        }
        readers.abort_all();
        let _ = tokio::time::timeout(Duration::from_secs(1), connection.close()).await;
    }
    0
}

type Deliveries = tokio::sync::mpsc::UnboundedReceiver<amqprs::channel::ConsumerMessage>;

async fn subscribe(connection: &Connection, queue: &str) -> Option<(Channel, Deliveries)> {
    let within = Duration::from_secs(5);
    let channel = tokio::time::timeout(within, connection.open_channel(None))
        .await
        .ok()?
        .ok()?;
    tokio::time::timeout(
        within,
        channel.basic_qos(BasicQosArguments::new(0, 500, false)),
    )
    .await
    .ok()?
    .ok()?;
    let mut args = BasicConsumeArguments::new(queue, "");
    args.manual_ack(true);
    let (_, deliveries) = tokio::time::timeout(within, channel.basic_consume_rx(args))
        .await
        .ok()?
        .ok()?;
    Some((channel, deliveries))
}

async fn read_queue(
    channel: Channel,
    mut deliveries: Deliveries,
    shard: usize,
    received: Received,
) {
    while let Some(message) = deliveries.recv().await {
        let (Some(deliver), Some(properties), Some(body)) =
            (message.deliver, message.basic_properties, message.content)
        else {
            continue;
        };
        let header =
            |name: &str| outbox_tests::rabbitmq::header(&properties, name).unwrap_or_default();
        let payload: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let tag = deliver.delivery_tag();
        match payload["seq"].as_u64() {
            Some(seq) => received.lock().unwrap().push((
                (header("outbox_key"), seq),
                (shard as i32, tag as i64, header("outbox_id")),
            )),
            None => eprintln!("unreadable message in shard {shard}: {} bytes", body.len()),
        }
        if channel
            .basic_ack(BasicAckArguments::new(tag, false))
            .await
            .is_err()
        {
            return;
        }
    }
}
