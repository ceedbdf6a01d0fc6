//! The relay tests' helpers: exchanges looked up and declared of any type, a queue read back
//! with each message's properties, and a TCP proxy that can hold back what the node says (its
//! confirms) without closing anything.

#[allow(unused_imports)]
use super::*;

/// Whether `exchange` exists on the node at `url` (a passive declaration: 404 is `false`).
pub async fn exchange_exists(url: &str, exchange: &str) -> bool {
    let (connection, channel, closed) = open(url).await;
    let answer = tokio::time::timeout(
        Duration::from_secs(10),
        channel.exchange_declare(
            ExchangeDeclareArguments::new(exchange, "direct")
                .passive(true)
                .finish(),
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("passive declaration of exchange {exchange} unanswered for 10 s"));
    close(connection, channel).await;
    match answer {
        Ok(()) => true,
        Err(_) if closed.not_found() => false,
        Err(e) => panic!(
            "passive declaration of exchange {exchange}: {}",
            closed.explain(&e)
        ),
    }
}

/// Declares the durable exchange `exchange` of type `kind` (`direct`, `fanout`, `topic`).
pub async fn declare_exchange(url: &str, exchange: &str, kind: &str) {
    let (connection, channel, closed) = open(url).await;
    channel
        .exchange_declare(
            ExchangeDeclareArguments::new(exchange, kind)
                .durable(true)
                .finish(),
        )
        .await
        .unwrap_or_else(|e| panic!("declare exchange {exchange}: {}", closed.explain(&e)));
    close(connection, channel).await;
}

/// Declares the classic durable queue `queue` and binds it to `exchange` (declared as the relay
/// does) for every shard `0..shards`: one queue that takes all of the topic's messages, each
/// key's in the order the node routed them.
pub async fn declare_queue_for_all_shards(url: &str, queue: &str, exchange: &str, shards: u16) {
    for shard in 0..shards {
        declare_queue_bound(url, queue, exchange, &shard.to_string()).await;
    }
}

/// [`declare_queue_for_all_shards`] with a length limit: a classic durable queue of `max_length` messages that
/// refuses (nacks) what does not fit (`x-overflow: reject-publish`).
pub async fn declare_limited_queue(
    url: &str,
    queue: &str,
    exchange: &str,
    shards: u16,
    max_length: i64,
) {
    let (connection, channel, closed) = open(url).await;
    let mut arguments = FieldTable::new();
    arguments.insert(
        "x-max-length".try_into().expect("short"),
        FieldValue::l(max_length),
    );
    arguments.insert(
        "x-overflow".try_into().expect("short"),
        FieldValue::from("reject-publish"),
    );
    channel
        .queue_declare(
            QueueDeclareArguments::new(queue)
                .durable(true)
                .arguments(arguments)
                .finish(),
        )
        .await
        .unwrap_or_else(|e| panic!("declare queue {queue}: {}", closed.explain(&e)));
    channel
        .exchange_declare(
            ExchangeDeclareArguments::of_type(exchange, ExchangeType::Direct)
                .durable(true)
                .finish(),
        )
        .await
        .unwrap_or_else(|e| panic!("declare exchange {exchange}: {}", closed.explain(&e)));
    for shard in 0..shards {
        channel
            .queue_bind(QueueBindArguments::new(queue, exchange, &shard.to_string()))
            .await
            .unwrap_or_else(|e| panic!("bind {queue} to {exchange}: {}", closed.explain(&e)));
    }
    close(connection, channel).await;
}

/// A message read back with the properties the Kafka-shaped [`Received`] leaves out.
#[derive(Debug, Clone)]
pub struct Message {
    pub record: Received,
    pub message_id: Option<String>,
    pub delivery_mode: Option<u8>,
    pub content_type: Option<String>,
    /// The routing key it was published with.
    pub routing_key: String,
}

/// Takes every message `queue` holds now (as many as its depth when called, each
/// acknowledged), with its properties, within 10 s.
pub async fn take_messages(url: &str, queue: &str) -> Vec<Message> {
    let depth = queue_depth(url, queue).await.unwrap_or(0) as usize;
    let mut out = Vec::new();
    take(
        url,
        queue,
        depth,
        Duration::from_secs(10),
        |routing_key, properties, body| {
            out.push(Message {
                message_id: properties.message_id().cloned(),
                delivery_mode: properties.delivery_mode(),
                content_type: properties.content_type().cloned(),
                routing_key: routing_key.to_owned(),
                record: received(routing_key, &properties, body, out.len() as i64),
            });
        },
    )
    .await;
    out
}

/// A TCP proxy in front of a RabbitMQ node that forwards bytes as they are, and can be paused:
/// what the node sends (confirms, returns, heartbeats, a new connection's handshake) is then
/// not read from its socket until [`resume`](Self::resume); what clients send still reaches
/// the node. Nothing is closed or dropped: a confirm that comes very late, as on a congested
/// network.
#[derive(Debug)]
pub struct PausingProxy {
    port: u16,
    paused: tokio::sync::watch::Sender<bool>,
    connections: Arc<std::sync::atomic::AtomicU64>,
}

impl PausingProxy {
    /// A proxy on a free port of 127.0.0.1 to `upstream` (`host:port`).
    pub async fn start(upstream: String) -> PausingProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let (paused, _) = tokio::sync::watch::channel(false);
        let connections = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (watch, count) = (paused.clone(), Arc::clone(&connections));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                tokio::spawn(forward(client, server, watch.subscribe()));
            }
        });
        PausingProxy {
            port,
            paused,
            connections,
        }
    }

    /// `url` (`amqp://user:password@host:port`) pointed at this proxy.
    pub fn url(&self, url: &str) -> String {
        let (head, rest) = url.split_once('@').expect("a URL with user info");
        let path = rest.find('/').map_or("", |i| &rest[i..]);
        format!("{head}@127.0.0.1:{}{path}", self.port)
    }

    /// Holds back what the node sends, from now on.
    pub fn pause(&self) {
        self.paused.send_replace(true);
    }

    /// Forwards what the node sent meanwhile, and what it sends next.
    pub fn resume(&self) {
        self.paused.send_replace(false);
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }
}

async fn forward(
    client: tokio::net::TcpStream,
    server: tokio::net::TcpStream,
    mut paused: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async move {
        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
        let _ = server_write.shutdown().await;
    };
    let downstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if paused.wait_for(|p| !*p).await.is_err() {
                break;
            }
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            // Read while running, held if a pause came meanwhile.
            if paused.wait_for(|p| !*p).await.is_err() {
                break;
            }
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = client_write.shutdown().await;
    };
    tokio::join!(upstream, downstream);
}
