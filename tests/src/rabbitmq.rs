//! RabbitMQ for the tests: a node of a test's own (a port, a node name and a data directory of
//! its own, so that tests running side by side never share a queue), which a test can kill and
//! start again; and helpers, usable against any node (a test's own or the shared one), that
//! declare, publish, measure and read back queues, reading messages as the Kafka tests'
//! records ([`Received`]) so that assertions can be shared.
//!
//! amqprs's `Connection` and `Channel` spawn a tokio task when dropped open: the helpers close
//! theirs, and what [`connect`] returns must be dropped inside the runtime.

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use amqprs::callbacks::ChannelCallback;
use amqprs::channel::{
    BasicAckArguments, BasicCancelArguments, BasicConsumeArguments, BasicPublishArguments,
    BasicQosArguments, Channel, ConsumerMessage, ExchangeDeclareArguments, ExchangeDeleteArguments,
    ExchangeType, QueueBindArguments, QueueDeclareArguments, QueueDeleteArguments,
};
use amqprs::connection::{Connection, OpenConnectionArguments};
use amqprs::{
    Ack, BasicProperties, Cancel, CloseChannel, FieldTable, FieldValue, Nack, Return,
    DELIVERY_MODE_PERSISTENT,
};

use tokio::sync::mpsc::UnboundedReceiver;

use crate::kafka::{Outgoing, Received};

/// The machine's shared RabbitMQ node (user guest, from 127.0.0.1, vhost `/`). Tests using it
/// name their exchanges and queues with [`unique_name`].
pub const SHARED_URL: &str = "amqp://guest:guest@127.0.0.1:5672";

/// How long a node has to accept an AMQP connection after it is started.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The server's start script: `RABBITMQ_SERVER_BIN`, or Debian's own (the one behind
/// `/usr/sbin/rabbitmq-server`, whose wrapper would run it under `su`, a process in between).
pub fn rabbitmq_server_bin() -> PathBuf {
    std::env::var_os("RABBITMQ_SERVER_BIN").map_or_else(
        || PathBuf::from("/usr/lib/rabbitmq/bin/rabbitmq-server"),
        PathBuf::from,
    )
}

/// A RabbitMQ node of a test's own, killed (and its directory removed) when dropped.
///
/// The node runs as the child process of the test (as user `rabbitmq` when the test runs as
/// root): the start script `exec`s `erl`, which `exec`s the Erlang VM, so the child's pid is
/// the `beam.smp` itself and [`kill`](Self::kill) kills the node, not a shell in front of it.
/// The machine's `epmd` (started on demand by the first node) is shared and left running.
///
/// Starting takes 6 to 9 s on the 2-core machine, a restart over existing data as long
/// (measured: 6.1-7.7 s alone, about 9 s with two nodes starting side by side; RabbitMQ's
/// own count, "Time to start RabbitMQ", 7.0 s: some 3 s the Erlang VM and the prelaunch, then
/// almost 3 s in which the broker computes its boot steps, CPU-bound). Start one node per test
/// that needs one, and only for what the shared node cannot show (a broker killed,
/// restarted).
#[derive(Debug)]
pub struct RabbitNode {
    /// AMQP port (127.0.0.1).
    port: u16,
    /// Erlang distribution port (127.0.0.1).
    dist_port: u16,
    /// The TLS listener's port (127.0.0.1), 0 if none.
    tls_port: u16,
    /// `outbox_<uuid>@localhost`.
    node_name: String,
    dir: PathBuf,
    child: Option<Child>,
}

/// The uid and gid of the node's processes, when the test runs as root (RabbitMQ is run as
/// its own user, as the shared node is); `None` runs it as the test's user.
fn run_as() -> Option<(u32, u32)> {
    let me = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(0);
    if me != 0 {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").expect("read /etc/passwd");
    let entry = passwd
        .lines()
        .find(|l| l.starts_with("rabbitmq:"))
        .expect("a `rabbitmq` user (Debian's package rabbitmq-server)");
    let fields: Vec<&str> = entry.split(':').collect();
    Some((
        fields[2].parse().expect("numeric uid"),
        fields[3].parse().expect("numeric gid"),
    ))
}

/// Two distinct free ports on 127.0.0.1.
fn free_ports() -> (u16, u16) {
    let a = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
    let b = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
    (
        a.local_addr().expect("port").port(),
        b.local_addr().expect("port").port(),
    )
}

/// A CA and a certificate for `localhost` signed by it, in `dir` (`ca.pem`, `server.pem`,
/// `server.key`), made with the `openssl` command.
fn make_certificates(dir: &Path) {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("run openssl (Debian's package openssl)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=outbox test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName = DNS:localhost, IP:127.0.0.1\n",
    )
    .expect("server.ext");
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "server.ext",
        "-out",
        "server.pem",
    ]);
}

/// The last `lines` lines of `path` (empty if it cannot be read).
fn tail(path: &Path, lines: usize) -> String {
    let mut text = String::new();
    if let Ok(mut file) = std::fs::File::open(path) {
        let _ = file.read_to_string(&mut text);
    }
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

impl RabbitNode {
    /// A new node on free ports, with an empty data directory; returns once it accepts an
    /// AMQP connection.
    pub async fn start() -> RabbitNode {
        RabbitNode::start_with(false).await
    }

    /// [`start`](Self::start), with a TLS listener too ([`tls_url`](Self::tls_url)): its
    /// certificate is for `localhost`, signed by a CA of the node's own
    /// ([`ca_file`](Self::ca_file)); the node asks for no client certificate.
    pub async fn start_tls() -> RabbitNode {
        RabbitNode::start_with(true).await
    }

    async fn start_with(tls: bool) -> RabbitNode {
        let (port, dist_port) = free_ports();
        let tls_port = if tls { free_ports().0 } else { 0 };
        let id = uuid::Uuid::new_v4().simple();
        let node_name = format!("outbox_{id}@localhost");
        let dir = std::env::temp_dir().join(format!("outbox-rabbitmq-{id}"));
        std::fs::create_dir_all(dir.join("db")).expect("rabbitmq db dir");
        std::fs::create_dir_all(dir.join("log")).expect("rabbitmq log dir");
        let mut conf = format!("listeners.tcp.local = 127.0.0.1:{port}\n");
        let mut owned = vec!["", "db", "log", "rabbitmq.conf", "plugins"];
        if tls {
            make_certificates(&dir);
            let file = |name: &str| dir.join(name).display().to_string();
            conf.push_str(&format!(
                "listeners.ssl.local = 127.0.0.1:{tls_port}\n\
                 ssl_options.cacertfile = {}\n\
                 ssl_options.certfile = {}\n\
                 ssl_options.keyfile = {}\n\
                 ssl_options.verify = verify_none\n\
                 ssl_options.fail_if_no_peer_cert = false\n",
                file("ca.pem"),
                file("server.pem"),
                file("server.key"),
            ));
            owned.extend(["ca.pem", "server.pem", "server.key"]);
        }
        std::fs::write(dir.join("rabbitmq.conf"), conf).expect("rabbitmq.conf");
        std::fs::write(dir.join("plugins"), "[].\n").expect("plugins file");
        if let Some((uid, gid)) = run_as() {
            for path in owned {
                std::os::unix::fs::chown(dir.join(path), Some(uid), Some(gid))
                    .expect("chown the node's directory to rabbitmq");
            }
        }
        let mut node = RabbitNode {
            port,
            dist_port,
            tls_port,
            node_name,
            dir,
            child: None,
        };
        node.spawn().await;
        node
    }

    /// `amqps://guest:guest@localhost:<tls port>` (a node from [`start_tls`](Self::start_tls)).
    pub fn tls_url(&self) -> String {
        assert!(self.tls_port != 0, "a node started without TLS");
        format!("amqps://guest:guest@localhost:{}", self.tls_port)
    }

    /// The CA certificate (PEM) that signed the TLS listener's certificate.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// `amqp://guest:guest@127.0.0.1:<port>`: the default vhost `/` is a URL without a path
    /// (amqprs does not percent-decode the path: `/%2f` would be a vhost named `%2f`).
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The Erlang node name, `outbox_<uuid>@localhost`.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// The OS pid of the node's Erlang VM, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The end of the node's output and log: what to show when it misbehaves.
    pub fn log_tail(&self) -> String {
        format!(
            "--- stdout/stderr ---\n{}\n--- {}.log ---\n{}",
            tail(&self.dir.join("stdout.log"), 20),
            self.node_name,
            tail(
                &self.dir.join("log").join(format!("{}.log", self.node_name)),
                40
            )
        )
    }

    /// Starts the node (again, with its data directory: durable queues and their persistent
    /// messages are still there), and waits until it accepts an AMQP connection.
    pub async fn spawn(&mut self) {
        assert!(self.child.is_none(), "the node is already running");
        let bin = rabbitmq_server_bin();
        assert!(
            bin.exists(),
            "rabbitmq-server is not installed at {} (Debian's package rabbitmq-server, or set \
             RABBITMQ_SERVER_BIN)",
            bin.display()
        );
        let log = std::fs::File::create(self.dir.join("stdout.log")).expect("rabbitmq log");
        let mut command = Command::new(bin);
        // `-noinput` (no Erlang shell) as an argument of `erl`: `RABBITMQ_ALLOW_INPUT` is what
        // makes the script `exec` the VM instead of running it in the background and waiting.
        command
            .arg("-noinput")
            .current_dir(&self.dir)
            .env("HOME", &self.dir)
            .env("RABBITMQ_ALLOW_INPUT", "true")
            .env("RABBITMQ_NODENAME", &self.node_name)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_CONFIG_FILE", self.dir.join("rabbitmq.conf"))
            .env(
                "RABBITMQ_ADVANCED_CONFIG_FILE",
                self.dir.join("advanced.config"),
            )
            .env("RABBITMQ_MNESIA_BASE", self.dir.join("db"))
            .env("RABBITMQ_LOG_BASE", self.dir.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", self.dir.join("plugins"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        if let Some((uid, gid)) = run_as() {
            command.uid(uid).gid(gid);
        }
        let child = command.spawn().expect("start rabbitmq-server");
        self.child = Some(child);
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                panic!(
                    "rabbitmq node {} exited ({status}) before accepting connections\n{}",
                    self.node_name,
                    self.log_tail()
                );
            }
            match answering_node(&self.url()).await {
                // `cluster_name` defaults to the node's name at the machine's hostname.
                Some(name) if name.split('@').next() == self.node_name.split('@').next() => break,
                // Another node on this port (a port reused since it was picked): this one
                // cannot bind it, and exits; or it is not ready yet.
                Some(other) => eprintln!(
                    "port {} answers as {other}, not {}: waiting",
                    self.port, self.node_name
                ),
                None => {}
            }
            if tokio::time::Instant::now() >= deadline {
                self.kill();
                panic!(
                    "rabbitmq node {} did not accept an AMQP connection on port {} within {} \
                     s\n{}",
                    self.node_name,
                    self.port,
                    START_TIMEOUT.as_secs(),
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let pid = self.pid().expect("running");
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        assert_eq!(
            comm.trim(),
            "beam.smp",
            "the node's process {pid} is not the Erlang VM: kill() would not stop the node"
        );
    }

    /// SIGKILL to the Erlang VM: gone at once, no goodbye to its clients, nothing flushed that
    /// was not. Returns once its AMQP port is closed. The VM's helpers (`erl_child_setup`,
    /// `inet_gethost`, the disk monitor's shell) end by themselves as their pipes close.
    pub fn kill(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = child.kill();
        let _ = child.wait();
        let address = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect_timeout(&address, Duration::from_millis(200)).is_ok() {
            assert!(
                std::time::Instant::now() < deadline,
                "port {} still open 10 s after the node was killed",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for RabbitNode {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The name of the node that accepts an AMQP connection at `url` (its `cluster_name`: unless
/// set, the node's name at the machine's hostname, `outbox_<uuid>@vm` for
/// `outbox_<uuid>@localhost`), `None` if none does within 5 s.
async fn answering_node(url: &str) -> Option<String> {
    let args = OpenConnectionArguments::try_from(url).ok()?;
    let connection = tokio::time::timeout(Duration::from_secs(5), Connection::open(&args))
        .await
        .ok()?
        .ok()?;
    let name = connection.server_properties().cluster_name().to_owned();
    let _ = connection.close().await;
    Some(name)
}

/// `prefix`, a dash and 12 hex digits of a fresh uuid: a name (topic, group, queue, exchange)
/// no other test uses, on the shared node too (where nothing removes a test's queues but the
/// test: see [`delete_queue`], [`delete_exchange`]).
pub fn unique_name(prefix: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}-{}", &id[..12])
}

/// Why the node closed a channel: its `channel.close` (reply code and text), recorded by the
/// channel's callback before the request that caused it fails (amqprs's error does not say).
#[derive(Clone, Default)]
struct Closed(Arc<Mutex<Option<(u16, String)>>>);

impl Closed {
    fn reason(&self) -> Option<(u16, String)> {
        self.0.lock().expect("not poisoned").clone()
    }

    /// Whether the node closed the channel with 404 NOT_FOUND (no such queue or exchange).
    fn not_found(&self) -> bool {
        self.reason().is_some_and(|(code, _)| code == 404)
    }

    /// `error`, with the node's reason when it closed the channel.
    fn explain(&self, error: &amqprs::error::Error) -> String {
        match self.reason() {
            Some((code, text)) => format!("{code} {text}"),
            None => error.to_string(),
        }
    }
}

type Boxed<'a, T> = Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// amqprs's `ChannelCallback` is an `async_trait` trait: written out as that macro would, the
/// tests not depending on `async-trait`.
impl ChannelCallback for Closed {
    fn close<'s, 'c, 'a>(
        &'s mut self,
        _channel: &'c Channel,
        close: CloseChannel,
    ) -> Boxed<'a, Result<(), amqprs::error::Error>>
    where
        's: 'a,
        'c: 'a,
        Self: 'a,
    {
        *self.0.lock().expect("not poisoned") =
            Some((close.reply_code(), close.reply_text().clone()));
        Box::pin(async { Ok(()) })
    }

    fn cancel<'s, 'c, 'a>(
        &'s mut self,
        _channel: &'c Channel,
        _cancel: Cancel,
    ) -> Boxed<'a, Result<(), amqprs::error::Error>>
    where
        's: 'a,
        'c: 'a,
        Self: 'a,
    {
        Box::pin(async { Ok(()) })
    }

    fn flow<'s, 'c, 'a>(
        &'s mut self,
        _channel: &'c Channel,
        active: bool,
    ) -> Boxed<'a, Result<bool, amqprs::error::Error>>
    where
        's: 'a,
        'c: 'a,
        Self: 'a,
    {
        Box::pin(async move { Ok(active) })
    }

    fn publish_ack<'s, 'c, 'a>(&'s mut self, _channel: &'c Channel, _ack: Ack) -> Boxed<'a, ()>
    where
        's: 'a,
        'c: 'a,
        Self: 'a,
    {
        Box::pin(async {})
    }

    fn publish_nack<'s, 'c, 'a>(&'s mut self, _channel: &'c Channel, _nack: Nack) -> Boxed<'a, ()>
    where
        's: 'a,
        'c: 'a,
        Self: 'a,
    {
        Box::pin(async {})
    }

    fn publish_return<'s, 'c, 'a>(
        &'s mut self,
        _channel: &'c Channel,
        _ret: Return,
        _basic_properties: BasicProperties,
        _content: Vec<u8>,
    ) -> Boxed<'a, ()>
    where
        's: 'a,
        'c: 'a,
        Self: 'a,
    {
        Box::pin(async {})
    }
}

/// A connection to `url` and a channel on it; panics naming the URL if the node refuses.
/// Drop them inside the tokio runtime (or close them).
pub async fn connect(url: &str) -> (Connection, Channel) {
    let (connection, channel, _) = open(url).await;
    (connection, channel)
}

/// [`connect`], and what records why the node closes the channel.
async fn open(url: &str) -> (Connection, Channel, Closed) {
    let mut args = OpenConnectionArguments::try_from(url)
        .unwrap_or_else(|e| panic!("not an AMQP URL {url}: {e}"));
    args.connection_name("outbox-tests");
    let connection = tokio::time::timeout(Duration::from_secs(10), Connection::open(&args))
        .await
        .unwrap_or_else(|_| panic!("connecting to {url} took over 10 s"))
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    let (channel, closed) = open_channel(&connection, url).await;
    (connection, channel, closed)
}

async fn open_channel(connection: &Connection, url: &str) -> (Channel, Closed) {
    let channel = connection
        .open_channel(None)
        .await
        .unwrap_or_else(|e| panic!("open a channel on {url}: {e}"));
    let closed = Closed::default();
    channel
        .register_callback(closed.clone())
        .await
        .unwrap_or_else(|e| panic!("register a channel callback on {url}: {e}"));
    (channel, closed)
}

async fn close(connection: Connection, channel: Channel) {
    let _ = channel.close().await;
    let _ = connection.close().await;
}

/// Declares the durable queue `queue` (a classic queue), and unless `exchange` is the default
/// exchange (`""`, which routes by queue name and takes no bindings) declares `exchange` as
/// the relay does (durable, direct) and binds the queue to it with `routing_key`. Idempotent.
/// A queue a test reads on the side must not be one of the runtime's own (its shard queues
/// are quorum queues: declared differently, the second declaration fails).
pub async fn declare_queue_bound(url: &str, queue: &str, exchange: &str, routing_key: &str) {
    let (connection, channel, closed) = open(url).await;
    channel
        .queue_declare(QueueDeclareArguments::new(queue).durable(true).finish())
        .await
        .unwrap_or_else(|e| panic!("declare queue {queue}: {}", closed.explain(&e)));
    if !exchange.is_empty() {
        channel
            .exchange_declare(
                ExchangeDeclareArguments::of_type(exchange, ExchangeType::Direct)
                    .durable(true)
                    .finish(),
            )
            .await
            .unwrap_or_else(|e| panic!("declare exchange {exchange}: {}", closed.explain(&e)));
        channel
            .queue_bind(QueueBindArguments::new(queue, exchange, routing_key))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "bind {queue} to {exchange} by {routing_key:?}: {}",
                    closed.explain(&e)
                )
            });
    }
    close(connection, channel).await;
}

/// Publishes one persistent message to `exchange` with `routing_key`, `headers` as long
/// strings, and returns once the node has it: the channel is transactional, and RabbitMQ
/// answers the commit once the message is routed and, on a durable queue, written to disk
/// (transactions are built on publisher confirms). Unroutable, it is dropped, as AMQP does.
pub async fn publish_raw(
    url: &str,
    exchange: &str,
    routing_key: &str,
    headers: &[(&str, &str)],
    payload: &[u8],
) {
    let (connection, channel, closed) = open(url).await;
    channel.tx_select().await.expect("tx.select");
    publish_on(&channel, exchange, routing_key, headers, payload).await;
    channel.tx_commit().await.unwrap_or_else(|e| {
        panic!(
            "publish to {exchange:?}/{routing_key}: {}",
            closed.explain(&e)
        )
    });
    close(connection, channel).await;
}

/// Publishes `records` in order to `exchange` with `routing_key`, each as the relay sends an
/// event (its key in `outbox_key`, its headers as long strings, persistent), in one transaction:
/// returns once the node has them all (see [`publish_raw`]).
pub async fn publish(url: &str, exchange: &str, routing_key: &str, records: &[Outgoing]) {
    let (connection, channel, closed) = open(url).await;
    channel.tx_select().await.expect("tx.select");
    for record in records {
        let mut headers: Vec<(&str, &str)> = vec![("outbox_key", record.key.as_str())];
        headers.extend(
            record
                .headers
                .iter()
                .map(|(name, value)| (name.as_str(), value.as_str())),
        );
        publish_on(&channel, exchange, routing_key, &headers, &record.payload).await;
    }
    channel.tx_commit().await.unwrap_or_else(|e| {
        panic!(
            "publish to {exchange:?}/{routing_key}: {}",
            closed.explain(&e)
        )
    });
    close(connection, channel).await;
}

async fn publish_on(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    headers: &[(&str, &str)],
    payload: &[u8],
) {
    let mut table = FieldTable::new();
    for (name, value) in headers {
        let name = (*name)
            .try_into()
            .unwrap_or_else(|_| panic!("header name {name:?} over 255 bytes"));
        table.insert(name, FieldValue::from(*value));
    }
    let mut properties = BasicProperties::default();
    properties
        .with_delivery_mode(DELIVERY_MODE_PERSISTENT)
        .with_headers(table);
    channel
        .basic_publish(
            properties,
            payload.to_vec(),
            BasicPublishArguments::new(exchange, routing_key),
        )
        .await
        .unwrap_or_else(|e| panic!("publish to {exchange:?}/{routing_key}: {e}"));
}

/// How many messages `queue` holds ready (not delivered and unacknowledged): a passive
/// declaration's answer. `None` if the node answers that there is no such queue (404); any
/// other failure panics with the node's reason.
pub async fn queue_depth(url: &str, queue: &str) -> Option<u32> {
    // A passive declaration of a missing queue closes the channel: a connection of its own,
    // closed after.
    let (connection, channel, closed) = open(url).await;
    let answer = tokio::time::timeout(
        Duration::from_secs(10),
        channel.queue_declare(QueueDeclareArguments::new(queue).passive(true).finish()),
    )
    .await
    .unwrap_or_else(|_| panic!("passive declaration of {queue} unanswered for 10 s"));
    close(connection, channel).await;
    match answer {
        Ok(Some((_, messages, _))) => Some(messages),
        Ok(None) => unreachable!("a declaration waited for is answered"),
        Err(_) if closed.not_found() => None,
        Err(e) => panic!(
            "passive declaration of {queue} on {url}: {}",
            closed.explain(&e)
        ),
    }
}

/// Deletes `queue` (with its messages), if it is there.
pub async fn delete_queue(url: &str, queue: &str) {
    let (connection, channel) = connect(url).await;
    let _ = channel.queue_delete(QueueDeleteArguments::new(queue)).await;
    close(connection, channel).await;
}

/// Deletes `exchange` (with its bindings), if it is there.
pub async fn delete_exchange(url: &str, exchange: &str) {
    let (connection, channel) = connect(url).await;
    let _ = channel
        .exchange_delete(ExchangeDeleteArguments::new(exchange))
        .await;
    close(connection, channel).await;
}

/// Takes messages from `queue` (each acknowledged: they leave the queue) until `expected` are
/// read or `within` passes, and returns them in the order read, as the Kafka tests' records
/// (see [`received`]). A queue missing (not declared yet) reads as empty until it appears; any
/// other failure (the node refusing, the connection lost) panics.
pub async fn read_queue(
    url: &str,
    queue: &str,
    expected: usize,
    within: Duration,
) -> Vec<Received> {
    let mut out = Vec::new();
    take(
        url,
        queue,
        expected,
        within,
        |routing_key, properties, body| {
            out.push(received(routing_key, &properties, body, out.len() as i64));
        },
    )
    .await;
    out
}

/// Takes up to `expected` messages of `queue` within `within`, each acknowledged once `each`
/// has it: read through a consumer of prefetch 1, cancelled before the last one is
/// acknowledged, so that nothing past `expected` is taken. (Not `basic.get`: amqprs's channel
/// task panicked on a `get-ok`, "get responder must be registered", under the parallel suite.)
/// A missing queue is waited for; any other failure panics.
pub(crate) async fn take(
    url: &str,
    queue: &str,
    expected: usize,
    within: Duration,
    mut each: impl FnMut(&str, BasicProperties, Vec<u8>),
) {
    let deadline = tokio::time::Instant::now() + within;
    let (connection, mut channel, mut closed) = open(url).await;
    let mut read = 0;
    if expected > 0 {
        let (tag, mut deliveries) = loop {
            match consume(&channel, queue, 1).await {
                Ok(consumer) => break consumer,
                // The queue is missing: the node closed the channel. Another one, and wait.
                Err(_) if closed.not_found() && tokio::time::Instant::now() < deadline => {
                    (channel, closed) = open_channel(&connection, url).await;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(_) if closed.not_found() => {
                    close(connection, channel).await;
                    return;
                }
                Err(e) => panic!("consume {queue} at {url}: {}", closed.explain(&e)),
            }
        };
        while read < expected {
            let Ok(message) = tokio::time::timeout_at(deadline, deliveries.recv()).await else {
                break;
            };
            let Some(ConsumerMessage {
                deliver: Some(deliver),
                basic_properties: Some(properties),
                content: Some(body),
                ..
            }) = message
            else {
                panic!(
                    "the consumer of {queue} at {url} ended: {:?}",
                    closed.reason()
                );
            };
            read += 1;
            each(deliver.routing_key(), properties, body);
            if read == expected {
                // With this one unacknowledged, the node sends no other before the cancel.
                channel
                    .basic_cancel(BasicCancelArguments::new(&tag))
                    .await
                    .unwrap_or_else(|e| panic!("cancel the consumer of {queue}: {e}"));
            }
            channel
                .basic_ack(BasicAckArguments::new(deliver.delivery_tag(), false))
                .await
                .unwrap_or_else(|e| panic!("acknowledge a message of {queue}: {e}"));
        }
    }
    close(connection, channel).await;
}

/// Receives the first `n` messages of `queue` on a consumer of prefetch `n` and goes away
/// without acknowledging any (its connection closed, as a consumer that crashed), so that the
/// node returns them; waits until it has. Returns their `event_id` headers, in the order
/// received.
pub async fn hold_and_go_away(url: &str, vhost: &str, queue: &str, n: u16) -> Vec<String> {
    let (connection, channel, closed) = open(url).await;
    let (_, mut deliveries) = consume(&channel, queue, n)
        .await
        .unwrap_or_else(|e| panic!("consume {queue} at {url}: {}", closed.explain(&e)));
    let mut held = Vec::new();
    while held.len() < usize::from(n) {
        let message = tokio::time::timeout(Duration::from_secs(10), deliveries.recv())
            .await
            .unwrap_or_else(|_| panic!("{queue} delivered {} of {n} in 10 s", held.len()));
        let properties = message
            .and_then(|m| m.basic_properties)
            .unwrap_or_else(|| panic!("the consumer of {queue} ended: {:?}", closed.reason()));
        held.push(header(&properties, "event_id").unwrap_or_default());
    }
    close(connection, channel).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while ops::list_queues(None, vhost)
        .iter()
        .any(|q| q.name == queue && (q.unacked > 0 || q.consumers > 0))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{queue} did not take back what its consumer held within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    held
}

/// A consumer of `queue` on `channel`, of prefetch `prefetch` and manual acknowledgements. A
/// node answers at once; one that does not within 10 s is broken.
async fn consume(
    channel: &Channel,
    queue: &str,
    prefetch: u16,
) -> Result<(String, UnboundedReceiver<ConsumerMessage>), amqprs::error::Error> {
    let answer = async {
        channel
            .basic_qos(BasicQosArguments::new(0, prefetch, false))
            .await?;
        let mut args = BasicConsumeArguments::new(queue, "");
        args.manual_ack(true);
        channel.basic_consume_rx(args).await
    };
    tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .unwrap_or_else(|_| panic!("basic.consume on {queue} unanswered for 10 s"))
}

/// A header's value as text: a string's own; any other type's `Display` (a number, a
/// boolean; a table, an array or bytes as amqprs prints them).
fn header_text(value: &FieldValue) -> String {
    match value {
        FieldValue::S(s) => AsRef::<String>::as_ref(s).clone(),
        other => other.to_string(),
    }
}

/// Header `name` of a message, as text (a number or a byte string too), if it has it.
pub fn header(properties: &BasicProperties, name: &str) -> Option<String> {
    properties
        .headers()?
        .as_ref()
        .iter()
        .find_map(|(key, value)| (AsRef::<String>::as_ref(key) == name).then(|| header_text(value)))
}

/// A message taken from a queue as the Kafka tests' record: the body as `raw` (and as
/// `payload` if it is JSON), every header (the server's `x-*` too) as text, the key from
/// `outbox_key`, the timestamp from `outbox_timestamp_ms`, the partition from the routing key
/// if it is a number (the relay's shard) else 0, and `offset` its place in the reading.
pub fn received(
    routing_key: &str,
    properties: &BasicProperties,
    body: Vec<u8>,
    offset: i64,
) -> Received {
    let headers: HashMap<String, String> = properties
        .headers()
        .map(|table| {
            table
                .as_ref()
                .iter()
                .map(|(name, value)| (AsRef::<String>::as_ref(name).clone(), header_text(value)))
                .collect()
        })
        .unwrap_or_default();
    Received {
        key: headers.get("outbox_key").cloned().unwrap_or_default(),
        payload: serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
        raw: body,
        timestamp_ms: headers
            .get("outbox_timestamp_ms")
            .and_then(|t| t.parse().ok()),
        headers,
        partition: routing_key.parse().unwrap_or(0),
        offset,
    }
}

// The consumer tests' helpers (a vhost of a test's own, `rabbitmqctl`'s view, publishing as
// the relay does, a proxy that goes dark, ...).
mod ops;
pub use ops::*;

// The relay's tests' helpers (exchanges looked up and declared of any type, a queue read back
// with each message's properties, a proxy that holds back what the node says).
mod relay_ops;
pub use relay_ops::*;
