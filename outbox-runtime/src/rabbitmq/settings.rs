//! [`RabbitMq`]: the settings a user gives for RabbitMQ.

use std::path::PathBuf;
use std::time::Duration;

use amqprs::connection::OpenConnectionArguments;

/// RabbitMQ as a relay, consumer or replay talks to it: the server's URL and the topology's
/// shape. Give it to `RelayBuilder::rabbitmq`, `ConsumerBuilder::rabbitmq` or
/// `Replay::rabbitmq`.
///
/// # The mapping
///
/// - **Exchange**: the event's topic names a durable `direct` exchange (`order.events`).
/// - **Shards**: a key's hash picks one of [`shards`](Self::shards) shards (FNV-1a of the
///   partition key, modulo the shard count: the same on every relay, in any language), and
///   the record is published with the shard's number as its routing key. Each consumer group
///   has one queue per shard, `<topic>.<group>.<shard>`, bound with that number: what a Kafka
///   partition is to a key, a shard queue is here. The relay and every consumer of a topic
///   must use the same shard count (a shard no queue is bound for is refused as unroutable:
///   held, not lost).
/// - **Order per key**: each shard queue has a single active consumer
///   (`x-single-active-consumer`): however many instances of a group run, one reads a shard at
///   a time, in the queue's order; another takes over when it goes away, and what it had not
///   acknowledged comes first. A plugin-free consistent-hash exchange does not exist, and
///   competing consumers on one queue would interleave a key's messages: hence shards.
/// - **Queues** are quorum queues by default ([`quorum_queues`](Self::quorum_queues)):
///   replicated, durable, with a delivery limit that dead-letters a message which keeps
///   coming back (a handler that crashes the process), the way a poison message must end.
/// - **Headers**: those a Kafka record carries (`event_id`, `event_type`, `aggregate_type`,
///   `aggregate_id`, `content-type`, `outbox_id`, the application's own, and with
///   [`CloudEvents`](crate::relay::CloudEvents) the attributes as `cloudEvents:*` headers, the
///   AMQP binding's prefix), plus `outbox_key` and `outbox_timestamp_ms`; the message's
///   `message_id` is the event id, `content_type` `application/json`, persistent.
/// - **Publisher confirms**: a row is marked published only once the server confirmed it and
///   did not return it; a `nack`, a return (no exchange, no queue bound for its shard), a
///   closed channel or a timeout leaves it unpublished. RabbitMQ has no duplicate window: what
///   a relay sends again after a crash or a lost confirm is delivered twice, and the consumers'
///   deduplication (by event id) makes its effect once.
///
/// # Topology
///
/// By default ([`declare_topology`](Self::declare_topology)) the relay declares each topic's
/// exchange before its first publish, and a consumer declares the exchange, its group's shard
/// queues and bindings, their retry (delay) queues and the dead-letter queue when it starts.
/// With `declare_topology(false)` nothing is declared: a missing exchange or queue holds the
/// topic's records (`outbox status` and the `outbox_relay_held` gauge show it) until an
/// operator creates them (`outbox topics ensure --transport rabbitmq`).
#[derive(Clone, PartialEq, Eq)]
pub struct RabbitMq {
    pub(crate) url: String,
    pub(crate) shards: u16,
    pub(crate) quorum: bool,
    pub(crate) declare: bool,
    pub(crate) heartbeat: Duration,
    /// PEM CA certificates to check the server against (else the URL's `cacertfile`, else
    /// the web's roots).
    pub(crate) tls_ca: Option<PathBuf>,
    /// A client certificate and its key, PEM (else the URL's `certfile` and `keyfile`).
    pub(crate) tls_client: Option<(PathBuf, PathBuf)>,
}

impl std::fmt::Debug for RabbitMq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMq")
            .field("url", &self.redacted_url())
            .field("shards", &self.shards)
            .field("quorum_queues", &self.quorum)
            .field("declare_topology", &self.declare)
            .field("heartbeat", &self.heartbeat)
            .field("tls_ca", &self.tls_ca)
            .field("tls_client", &self.tls_client)
            .finish()
    }
}

impl RabbitMq {
    /// The server at `url` (`amqp://user:password@host:5672/vhost`; `amqps://` with the
    /// `rabbitmq-tls` feature), with 4 shards, quorum queues, declaring the topology.
    pub fn new(url: impl Into<String>) -> Self {
        RabbitMq {
            url: url.into(),
            shards: 4,
            quorum: true,
            declare: true,
            heartbeat: Duration::from_secs(10),
            tls_ca: None,
            tls_client: None,
        }
    }

    /// How many shards (queues per consumer group) a topic has: how many consumer instances
    /// of a group can read it at once (default 4, at most 1,000). The same on the relay and
    /// every consumer of the topic.
    pub fn shards(mut self, shards: u16) -> Self {
        self.shards = shards;
        self
    }

    /// Whether the queues a consumer declares are quorum queues (default `true`), or classic
    /// ones (for a server whose quorum queues are off; no delivery limit then).
    pub fn quorum_queues(mut self, quorum: bool) -> Self {
        self.quorum = quorum;
        self
    }

    /// Whether the relay and consumers declare exchanges and queues (default `true`).
    pub fn declare_topology(mut self, declare: bool) -> Self {
        self.declare = declare;
        self
    }

    /// The AMQP heartbeat (default 10 s, at least 1 s): a connection that hears nothing for
    /// two of them is given up and opened again.
    pub fn heartbeat(mut self, heartbeat: Duration) -> Self {
        self.heartbeat = heartbeat;
        self
    }

    /// With an `amqps://` URL: the CA certificates (a PEM file) the server's certificate must
    /// chain to. Default: the URL's `cacertfile` parameter, else the web's public roots.
    pub fn tls_ca_certificates(mut self, pem_file: impl Into<PathBuf>) -> Self {
        self.tls_ca = Some(pem_file.into());
        self
    }

    /// With an `amqps://` URL: the client certificate (chain) and its private key, PEM files,
    /// for a server that asks for one. Default: the URL's `certfile` and `keyfile`.
    pub fn tls_client_certificate(
        mut self,
        certificate_pem: impl Into<PathBuf>,
        key_pem: impl Into<PathBuf>,
    ) -> Self {
        self.tls_client = Some((certificate_pem.into(), key_pem.into()));
        self
    }

    /// The URL without its password, for messages.
    pub(crate) fn redacted_url(&self) -> String {
        redacted(&self.url)
    }

    /// The server's URL with its password replaced by `***`, to show or log.
    pub fn url_for_display(&self) -> String {
        redacted(&self.url)
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        if !(1..=1000).contains(&self.shards) {
            return Err(format!(
                "shards must be between 1 and 1000, not {}",
                self.shards
            ));
        }
        if self.heartbeat < Duration::from_secs(1) || self.heartbeat.as_secs() > 600 {
            return Err(format!(
                "the heartbeat must be between 1 s and 10 min, not {:?}",
                self.heartbeat
            ));
        }
        self.connection_arguments("check").map(|_| ())
    }
}

impl RabbitMq {
    /// The connection arguments these settings give, named `name` (the server shows it).
    pub(crate) fn connection_arguments(
        &self,
        name: &str,
    ) -> Result<OpenConnectionArguments, String> {
        let cannot = |e: String| {
            format!(
                "the RabbitMQ URL `{}` cannot be used: {e}",
                self.redacted_url()
            )
        };
        let uri = super::uri::parse(&self.url).map_err(cannot)?;
        // amqprs joins host and port with a `:`: an IPv6 address goes in brackets.
        let host = if uri.host.contains(':') {
            format!("[{}]", uri.host)
        } else {
            uri.host.clone()
        };
        let mut args = OpenConnectionArguments::new(&host, uri.port, &uri.user, &uri.password);
        let heartbeat = match uri.param("heartbeat") {
            Some(secs) => secs.parse::<u16>().map_err(|_| {
                cannot(format!("the heartbeat `{secs}` is not a number of seconds"))
            })?,
            None => u16::try_from(self.heartbeat.as_secs().max(1)).unwrap_or(u16::MAX),
        };
        args.virtual_host(&uri.vhost)
            .heartbeat(heartbeat)
            .connection_name(&format!("outbox {name}"));
        if uri.tls {
            self.tls(&uri, &mut args).map_err(cannot)?;
        }
        Ok(args)
    }

    #[cfg(feature = "rabbitmq-tls")]
    fn tls(&self, uri: &super::uri::Uri, args: &mut OpenConnectionArguments) -> Result<(), String> {
        let ca = self
            .tls_ca
            .clone()
            .or_else(|| uri.param("cacertfile").map(PathBuf::from));
        let client = match (
            &self.tls_client,
            uri.param("certfile"),
            uri.param("keyfile"),
        ) {
            (Some(given), _, _) => Some(given.clone()),
            (None, Some(cert), Some(key)) => Some((cert.into(), key.into())),
            (None, None, None) => None,
            (None, _, _) => return Err("certfile and keyfile go together".into()),
        };
        let client = client.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
        args.tls_adaptor(super::tls::adaptor(&uri.host, ca.as_deref(), client)?);
        Ok(())
    }

    #[cfg(not(feature = "rabbitmq-tls"))]
    #[allow(clippy::unused_self)]
    fn tls(
        &self,
        _uri: &super::uri::Uri,
        _args: &mut OpenConnectionArguments,
    ) -> Result<(), String> {
        Err("amqps:// needs TLS, which this build does not have (feature `rabbitmq-tls`)".into())
    }
}

/// `url` with its password replaced by `***`.
pub(crate) fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.split_once('@') {
        Some((user_info, host)) => {
            let user = user_info.split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{host}")
        }
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_leaves_the_password_out() {
        let shown = format!("{:?}", RabbitMq::new("amqp://app:s3cret@mq:5672/prod"));
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("app:***@mq:5672/prod"), "{shown}");
    }

    #[test]
    fn passwords_are_left_out_of_urls() {
        assert_eq!(
            redacted("amqp://app:secret@mq:5672/prod"),
            "amqp://app:***@mq:5672/prod"
        );
        assert_eq!(redacted("amqp://mq:5672"), "amqp://mq:5672");
    }

    #[test]
    fn settings_that_cannot_work_are_refused() {
        assert!(RabbitMq::new("amqp://guest:guest@127.0.0.1:5672")
            .check()
            .is_ok());
        let e = RabbitMq::new("amqp://h").shards(0).check().unwrap_err();
        assert!(e.contains("shards"), "{e}");
        let e = RabbitMq::new("http://h").check().unwrap_err();
        assert!(e.contains("URL"), "{e}");
    }
}
