//! The consumer tests' helpers: a vhost of a test's own, the broker's view of queues and
//! consumers (RabbitMQ's command-line tools), the relay's shard of a key, publishing as the
//! relay does, the metrics recorder, a TCP proxy that can go dark, and syncing a node's
//! quorum-queue registry.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use super::{publish, unique_name, RabbitNode, SHARED_URL};
use crate::kafka::{Outgoing, Received};

/// `rabbitmqctl` against the shared node (`node` `None`) or a test's own, with `args`; its
/// standard output. Panics if it fails.
pub fn rabbitmqctl(node: Option<&RabbitNode>, args: &[&str]) -> String {
    rabbitmq_cli("rabbitmqctl", node, args)
}

/// RabbitMQ's command-line tool `tool` (`rabbitmqctl`, `rabbitmq-queues`,
/// `rabbitmq-diagnostics`) against the shared node (`node` `None`) or a test's own.
pub fn rabbitmq_cli(tool: &str, node: Option<&RabbitNode>, args: &[&str]) -> String {
    let mut command = Command::new(tool);
    if let Some(node) = node {
        let cookie = std::fs::read_to_string(node.dir.join(".erlang.cookie"))
            .expect("the node's Erlang cookie");
        command.args(["-n", &node.node_name, "--erlang-cookie", cookie.trim()]);
    }
    let out = command
        .args(args)
        .output()
        .expect("run RabbitMQ's CLI (Debian's package rabbitmq-server)");
    assert!(
        out.status.success(),
        "{tool} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A vhost of a test's own on the shared node (the user guest may do anything in it),
/// deleted with everything in it when dropped: the runtime's fixed topic names (exchange
/// `payment.events`, its `.dlq`) can then be used by tests running side by side.
pub struct Vhost {
    pub name: String,
}

impl Vhost {
    pub fn new(prefix: &str) -> Vhost {
        let name = unique_name(prefix);
        rabbitmqctl(None, &["add_vhost", &name]);
        rabbitmqctl(
            None,
            &["set_permissions", "-p", &name, "guest", ".*", ".*", ".*"],
        );
        Vhost { name }
    }

    /// `amqp://guest:guest@127.0.0.1:5672/<name>`.
    pub fn url(&self) -> String {
        format!("{SHARED_URL}/{}", self.name)
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["delete_vhost", &self.name])
            .output();
    }
}

/// One queue as `rabbitmqctl list_queues` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueState {
    pub name: String,
    /// Ready and unacknowledged.
    pub messages: u64,
    pub unacked: u64,
    pub consumers: u64,
}

/// Every queue of `vhost` on the shared node (`node` `None`) or a test's own.
pub fn list_queues(node: Option<&RabbitNode>, vhost: &str) -> Vec<QueueState> {
    let out = rabbitmqctl(
        node,
        &[
            "list_queues",
            "-p",
            vhost,
            "-q",
            "--no-table-headers",
            "name",
            "messages",
            "messages_unacknowledged",
            "consumers",
        ],
    );
    out.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split('\t').collect();
            let n = |i: usize| f.get(i)?.trim().parse::<u64>().ok();
            Some(QueueState {
                name: f.first()?.to_string(),
                messages: n(1)?,
                unacked: n(2)?,
                consumers: n(3)?,
            })
        })
        .collect()
}

/// The consumers of `vhost`'s queues: (queue, whether active), from `rabbitmqctl
/// list_consumers` (with a single active consumer, one per queue is).
pub fn list_consumers(node: Option<&RabbitNode>, vhost: &str) -> Vec<(String, bool)> {
    let out = rabbitmqctl(
        node,
        &[
            "list_consumers",
            "-p",
            vhost,
            "-q",
            "--no-table-headers",
            "queue_name",
            "active",
        ],
    );
    out.lines()
        .filter_map(|line| {
            let (queue, active) = line.split_once('\t')?;
            Some((queue.to_owned(), active.trim() == "true"))
        })
        .collect()
}

/// The relay's shard of partition key `key` among `shards` (FNV-1a 64 of its bytes, modulo):
/// the routing key a record of that key is published with.
pub fn shard_of(key: &str, shards: u16) -> u16 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (hash % u64::from(shards)) as u16
}

/// Publishes `records` to `exchange` as the relay does: each to its key's shard, in order.
pub async fn publish_sharded(url: &str, exchange: &str, shards: u16, records: &[Outgoing]) {
    for shard in 0..shards {
        let of_shard: Vec<Outgoing> = records
            .iter()
            .filter(|r| shard_of(&r.key, shards) == shard)
            .cloned()
            .collect();
        if !of_shard.is_empty() {
            publish(url, exchange, &shard.to_string(), &of_shard).await;
        }
    }
}

/// The value of gauge `name` labelled `label` = `value`, from this test binary's metrics
/// recorder (installed on first use: no other recorder may be in the binary).
pub fn gauge(name: &str, label: &str, value: &str) -> Option<f64> {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    static SNAPSHOTTER: std::sync::OnceLock<Snapshotter> = std::sync::OnceLock::new();
    let snapshotter = SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this test binary");
        snapshotter
    });
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find(|(key, _, _, _)| {
            key.key().name() == name
                && key
                    .key()
                    .labels()
                    .any(|l| l.key() == label && l.value() == value)
        })
        .and_then(|(_, _, _, v)| match v {
            DebugValue::Gauge(g) => Some(g.into_inner()),
            _ => None,
        })
}

/// A plain TCP proxy to a node's AMQP port, which a test can turn into a black hole: from then
/// on what either side sends is read and dropped (a consumer's acknowledgements never reach the
/// node), as when a process is frozen or its host vanishes; the node gives the connection up
/// after missed heartbeats.
pub struct TcpProxy {
    pub addr: std::net::SocketAddr,
    hole: Arc<std::sync::atomic::AtomicBool>,
}

impl TcpProxy {
    /// Forwards a free local port to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> TcpProxy {
        use std::sync::atomic::AtomicBool;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let hole = Arc::new(AtomicBool::new(false));
        let (upstream, h) = (upstream.to_owned(), Arc::clone(&hole));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pipe(cr, sw, Arc::clone(&h)));
                tokio::spawn(pipe(sr, cw, Arc::clone(&h)));
            }
        });
        TcpProxy { addr, hole }
    }

    /// From now on nothing passes, and nothing is closed.
    pub fn black_hole(&self) {
        self.hole.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// `amqp://guest:guest@<proxy>/<vhost>`.
    pub fn url(&self, vhost: &str) -> String {
        format!("amqp://guest:guest@{}/{vhost}", self.addr)
    }
}

/// Copies `from` to `to` until either closes; in a black hole, reads and drops.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    hole: Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if hole.load(std::sync::atomic::Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    if hole.load(std::sync::atomic::Ordering::SeqCst) {
        // Dropping `to` would close it: a vanished host closes nothing.
        std::future::pending::<()>().await;
    }
    let _ = to.shutdown().await;
}

impl RabbitNode {
    /// Writes the node's registry of quorum-queue Ra servers (`names.dets`) to disk now.
    ///
    /// RabbitMQ 3.10 (Ra 2.2) registers a new quorum queue's Ra server in a DETS table that
    /// reaches the disk only after 500 ms without any access to it (its `auto_save`), which a
    /// node under load may never have: a SIGKILL before that loses the registration, and on
    /// restart the node starts the queue as a new, empty Ra server that never elects a leader
    /// (a follower at term 0: `leader not known`, consumes and publishes unanswered), its
    /// messages orphaned in the old server's directory. Later Ra syncs the table on every
    /// registration (rabbitmq/ra#443; rabbitmq/rabbitmq-server#15725 shows the stuck state).
    /// A test that kills a node after declaring quorum queues calls this first, doing what a
    /// fixed server does by itself.
    pub fn sync_quorum_registry(&self) {
        let synced = rabbitmqctl(
            Some(self),
            &[
                "eval",
                "[dets:sync(T) || T <- dets:all(), \
                 lists:suffix(\"names.dets\", dets:info(T, filename))].",
            ],
        );
        assert!(synced.contains("ok"), "names.dets not synced: {synced}");
    }
}

/// A relay on `pool` to the vhost's RabbitMQ (`shards` shards).
pub fn relay_to<DB>(
    pool: &sqlx::Pool<DB>,
    vhost: &Vhost,
    shards: u16,
) -> outbox_runtime::relay::Relay
where
    DB: sqlx::Database,
    sqlx::Pool<DB>: Into<outbox_runtime::relay::Database>,
{
    outbox_runtime::relay::Relay::builder(pool.clone())
        .rabbitmq(outbox_runtime::relay::RabbitMq::new(vhost.url()).shards(shards))
        .build()
        .unwrap()
}

/// Has account `acct-1`'s deposits `seqs` emitted on `pool` and published by `relay` to the
/// vhost's `TOPIC` (`shards` shards, declared for `group`); returns `group`'s shard queue for
/// them.
pub async fn relay_deposits<DB>(
    pool: &sqlx::Pool<DB>,
    relay: &outbox_runtime::relay::Relay,
    vhost: &Vhost,
    shards: u16,
    group: &str,
    seqs: std::ops::Range<u64>,
) -> String
where
    DB: outbox_runtime::EmitDatabase,
{
    use crate::deposits::{deposit, Deposited, TOPIC};
    let rabbitmq = outbox_runtime::relay::RabbitMq::new(vhost.url()).shards(shards);
    rabbitmq.ensure_topology(TOPIC, group).await.unwrap();
    let events: Vec<Deposited> = seqs.map(|seq| deposit(1, seq)).collect();
    let mut uow = outbox_runtime::Uow::begin(pool).await.unwrap();
    uow.emit_all(&events).await.unwrap();
    uow.commit().await.unwrap();
    assert_eq!(relay.publish_pending().await.unwrap(), events.len() as u64);
    format!("{TOPIC}.{group}.{}", shard_of("acct-1", shards))
}

/// [`relay_deposits`] `first..first + 6`, then leaves the shard queue as a quorum queue does
/// when sessions end one after another holding what they took: a consumer went away holding
/// all six (returned in order), then one holding the first (returned behind the rest), then one
/// holding the second. The queue delivers the third to the sixth, then the first and the
/// second. Returns the six event ids, in the key's order.
pub async fn relayed_then_returned_out_of_order<DB>(
    pool: &sqlx::Pool<DB>,
    relay: &outbox_runtime::relay::Relay,
    vhost: &Vhost,
    shards: u16,
    first: u64,
) -> Vec<uuid::Uuid>
where
    DB: outbox_runtime::EmitDatabase,
{
    let url = vhost.url();
    let queue = relay_deposits(pool, relay, vhost, shards, "ledger", first..first + 6).await;
    let held = super::hold_and_go_away(&url, &vhost.name, &queue, 6).await;
    let once = super::hold_and_go_away(&url, &vhost.name, &queue, 1).await;
    assert_eq!(once, held[..1], "returned in order the first time");
    let twice = super::hold_and_go_away(&url, &vhost.name, &queue, 1).await;
    assert_eq!(
        twice,
        held[1..2],
        "the first, returned twice, is now behind the second"
    );
    held.iter().map(|id| id.parse().unwrap()).collect()
}

/// [`relay_deposits`] 6..11, then a consumer goes away holding all five: the queue returns
/// them in order, once each. Returns their event ids.
pub async fn relayed_then_returned_once<DB>(
    pool: &sqlx::Pool<DB>,
    relay: &outbox_runtime::relay::Relay,
    vhost: &Vhost,
    shards: u16,
) -> Vec<uuid::Uuid>
where
    DB: outbox_runtime::EmitDatabase,
{
    let queue = relay_deposits(pool, relay, vhost, shards, "ledger", 6..11).await;
    let held = super::hold_and_go_away(&vhost.url(), &vhost.name, &queue, 5).await;
    held.iter().map(|id| id.parse().unwrap()).collect()
}

/// Whether every queue of `topic`'s group `group` (its `shards` shard queues and their delay
/// queues) holds nothing, ready or unacknowledged: everything settled.
pub fn settled(vhost: &Vhost, topic: &str, group: &str, shards: u16) -> bool {
    let prefix = format!("{topic}.{group}.");
    let queues: Vec<_> = list_queues(None, &vhost.name)
        .into_iter()
        .filter(|q| q.name.starts_with(&prefix))
        .collect();
    queues.len() == 2 * usize::from(shards) && queues.iter().all(|q| q.messages == 0)
}

/// The `n` dead letters of `topic`, read from its dead-letter queue (waiting 2 s for one more,
/// so that one too many shows).
pub async fn dead_letters(url: &str, topic: &str, n: usize) -> Vec<Received> {
    let letters =
        super::read_queue(url, &format!("{topic}.dlq"), n + 1, Duration::from_secs(2)).await;
    assert_eq!(letters.len(), n, "{letters:?}");
    letters
}

/// The headers a dead letter of a payment read by group `orders` (its topic in `shards` shard
/// queues) must carry.
pub fn assert_dead_letter(letter: &Received, reason: &str, attempts: &str, shards: u16) {
    assert!(
        letter.header("dlq_error").contains(reason),
        "{} does not say {reason}",
        letter.header("dlq_error")
    );
    assert_eq!(letter.header("dlq_attempts"), attempts);
    assert_eq!(letter.header("dlq_source_topic"), crate::fixtures::PAYMENTS);
    let shard = shard_of(letter.header("outbox_key"), shards);
    assert_eq!(letter.header("dlq_source_partition"), shard.to_string());
    assert_eq!(letter.header("dlq_source_offset"), "0");
    assert_eq!(letter.header("dlq_group"), "orders");
}

/// Sum over the group's shard queues: (messages, unacknowledged, consumers).
pub fn shard_totals(
    node: Option<&RabbitNode>,
    vhost: &str,
    topic: &str,
    group: &str,
) -> (u64, u64, u64) {
    list_queues(node, vhost)
        .iter()
        .filter(|q| q.name.starts_with(&format!("{topic}.{group}.")) && !q.name.ends_with(".retry"))
        .fold((0, 0, 0), |(m, u, c), q| {
            (m + q.messages, u + q.unacked, c + q.consumers)
        })
}

/// For each of the `shards` shard queues of `topic`'s group `group`: (consumers, active ones).
pub fn shard_consumers(
    vhost: &Vhost,
    topic: &str,
    group: &str,
    shards: u16,
) -> std::collections::BTreeMap<String, (usize, usize)> {
    let mut by_queue = std::collections::BTreeMap::new();
    for shard in 0..shards {
        by_queue.insert(format!("{topic}.{group}.{shard}"), (0, 0));
    }
    for (queue, active) in list_consumers(None, &vhost.name) {
        if let Some((all, act)) = by_queue.get_mut(&queue) {
            *all += 1;
            *act += usize::from(active);
        }
    }
    by_queue
}
