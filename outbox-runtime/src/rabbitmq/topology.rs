//! Declaring a topic's topology for a consumer group, and reading what exists: the exchange,
//! one queue per shard (single active consumer, quorum, a delivery limit), each shard's delay
//! queue for retries, and the topic's dead-letter queue.
//!
//! Shard queue `<topic>.<group>.<n>` is bound to exchange `<topic>` with routing key `n`. Its
//! delay queue `<topic>.<group>.<n><retry suffix>` holds a retried message until its
//! per-message expiration, then dead-letters it back to the shard queue (through the default
//! exchange). A queue expires only the message at its head: a retry behind one with a longer
//! backoff waits for it, at most the longest backoff. The dead-letter queue `<topic><dlq
//! suffix>` is shared by the topic's groups (each dead letter names its group); the shard
//! queues dead-letter there too once the server's delivery limit is passed (a message that
//! keeps taking its consumer down).

use std::time::Duration;

use amqprs::channel::{
    Channel, ExchangeDeclareArguments, ExchangeType, QueueBindArguments, QueueDeclareArguments,
};
use amqprs::connection::Connection;
use amqprs::{FieldTable, FieldValue};

use super::link::{close_channel, open_channel, timed, NOT_FOUND};
use super::settings::RabbitMq;
use super::wire::shard_queue;

/// Deliveries of one message the server allows a shard queue (quorum queues), counting only
/// those that came back unacknowledged (a consumer that crashed or closed holding it): then it
/// is dead-lettered. Fixed, not `max_attempts`: a queue's arguments must be the same for every
/// instance that declares it, and handler failures are counted by the consumer itself.
pub(crate) const DELIVERY_LIMIT: i64 = 20;

/// A topic's topology for one consumer group.
pub(crate) struct Topology<'a> {
    pub(crate) settings: &'a RabbitMq,
    pub(crate) topic: &'a str,
    pub(crate) group: &'a str,
    pub(crate) retry_suffix: &'a str,
    pub(crate) dead_letters: &'a str,
}

impl Topology<'_> {
    pub(crate) fn shard_queue(&self, shard: u16) -> String {
        shard_queue(self.topic, self.group, shard)
    }

    pub(crate) fn delay_queue(&self, shard: u16) -> String {
        format!("{}{}", self.shard_queue(shard), self.retry_suffix)
    }

    /// Whether every name of the topology fits AMQP's 255 bytes (amqprs panics on a longer
    /// one), and the topic can name an exchange.
    pub(crate) fn check_names(&self) -> Result<(), String> {
        super::wire::check_exchange(self.topic)?;
        let longest = self.delay_queue(self.settings.shards.saturating_sub(1));
        let names = [longest.as_str(), self.dead_letters];
        let too_long = names.into_iter().find(|n| n.len() > 255);
        match too_long {
            Some(name) => Err(format!(
                "the RabbitMQ queue `{}…` would be {} bytes, over AMQP's 255: shorten the \
                 topic `{}`, the group or the suffixes",
                name.chars().take(60).collect::<String>(),
                name.len(),
                self.topic
            )),
            None => Ok(()),
        }
    }

    fn long(value: &str) -> FieldValue {
        FieldValue::from(value)
    }

    /// The arguments of a queue consumers read.
    fn read_arguments(&self, single_active: bool) -> FieldTable {
        let mut args = FieldTable::new();
        if self.settings.quorum {
            args.insert(
                "x-queue-type".try_into().expect("short"),
                Self::long("quorum"),
            );
        }
        if single_active {
            args.insert(
                "x-single-active-consumer".try_into().expect("short"),
                FieldValue::t(true),
            );
            if self.settings.quorum {
                args.insert(
                    "x-delivery-limit".try_into().expect("short"),
                    FieldValue::l(DELIVERY_LIMIT),
                );
                args.insert(
                    "x-dead-letter-exchange".try_into().expect("short"),
                    Self::long(""),
                );
                args.insert(
                    "x-dead-letter-routing-key".try_into().expect("short"),
                    Self::long(self.dead_letters),
                );
            }
        }
        args
    }

    /// Declares the exchange, the dead-letter queue, and every shard's queue, binding and
    /// delay queue (see [`declare`](Self::declare)).
    #[allow(dead_code)] // the CLI's `topics ensure`
    pub(crate) async fn declare_all(
        &self,
        channel: &Channel,
        within: Duration,
    ) -> Result<(), String> {
        for shard in 0..self.settings.shards {
            self.declare(channel, shard, within).await?;
        }
        Ok(())
    }

    /// Declares the exchange, the dead-letter queue, and shard `shard`'s queue, binding and
    /// delay queue, on `channel` (an argument that differs from an existing queue's closes the
    /// channel: the error says which).
    pub(crate) async fn declare(
        &self,
        channel: &Channel,
        shard: u16,
        within: Duration,
    ) -> Result<(), String> {
        let mut exchange = ExchangeDeclareArguments::of_type(self.topic, ExchangeType::Direct);
        exchange.durable(true);
        timed(
            within,
            &format!("cannot declare the exchange `{}`", self.topic),
            channel.exchange_declare(exchange),
        )
        .await?;
        let mut dead = QueueDeclareArguments::durable_client_named(self.dead_letters);
        dead.arguments(self.read_arguments(false));
        timed(
            within,
            &format!(
                "cannot declare the dead-letter queue `{}`",
                self.dead_letters
            ),
            channel.queue_declare(dead),
        )
        .await?;
        {
            let queue = self.shard_queue(shard);
            let mut args = QueueDeclareArguments::durable_client_named(&queue);
            args.arguments(self.read_arguments(true));
            timed(
                within,
                &format!("cannot declare the queue `{queue}` (declared before with other arguments? delete it, or match them: quorum_queues)"),
                channel.queue_declare(args),
            )
            .await?;
            timed(
                within,
                &format!("cannot bind the queue `{queue}`"),
                channel.queue_bind(QueueBindArguments::new(
                    &queue,
                    self.topic,
                    &shard.to_string(),
                )),
            )
            .await?;
            let delay = self.delay_queue(shard);
            let mut table = FieldTable::new();
            table.insert(
                "x-dead-letter-exchange".try_into().expect("short"),
                Self::long(""),
            );
            table.insert(
                "x-dead-letter-routing-key".try_into().expect("short"),
                Self::long(&queue),
            );
            let mut args = QueueDeclareArguments::durable_client_named(&delay);
            args.arguments(table);
            timed(
                within,
                &format!("cannot declare the delay queue `{delay}`"),
                channel.queue_declare(args),
            )
            .await?;
        }
        Ok(())
    }
}

/// Whether every name of consumer `settings`'s topology for `topic` fits AMQP.
pub(crate) fn check_names(
    rabbitmq: &RabbitMq,
    settings: &crate::inbox::settings::Settings,
    topic: &str,
) -> Result<(), String> {
    let dead = settings.topics.dead_letter(topic);
    Topology {
        settings: rabbitmq,
        topic,
        group: settings.group(),
        retry_suffix: &settings.topics.retry_suffix,
        dead_letters: &dead,
    }
    .check_names()
}

/// What a queue holds: `None` if it does not exist (a passive declare, on a channel of its
/// own: one that finds nothing closes its channel).
pub(crate) async fn depth(
    connection: &Connection,
    queue: &str,
    within: Duration,
) -> Result<Option<QueueDepth>, String> {
    let (channel, closed) = open_channel(connection, within).await?;
    let mut args = QueueDeclareArguments::new(queue);
    args.passive(true);
    let declared = timed(
        within,
        "cannot look the queue up",
        channel.queue_declare(args),
    )
    .await;
    close_channel(channel);
    match declared {
        Ok(Some((_, messages, consumers))) => Ok(Some(QueueDepth {
            messages,
            consumers,
        })),
        Ok(None) => Ok(None),
        Err(_) if closed.code() == Some(NOT_FOUND) => Ok(None),
        Err(e) => Err(closed.explain(e)),
    }
}

/// A queue's messages ready for delivery, and its consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueDepth {
    /// Messages ready (not counting those delivered and not yet acknowledged).
    pub messages: u32,
    /// Consumers subscribed (with a single active consumer, one of them receives).
    pub consumers: u32,
}

/// What exists of a topic's topology for a group: each queue with its depth (`None`: missing).
pub type Report = Vec<(String, Option<QueueDepth>)>;

impl RabbitMq {
    /// Declares `topic`'s exchange and, for consumer group `group`, every shard's queue,
    /// binding and delay queue, and the dead-letter queue (the default suffixes, `.retry` and
    /// `.dlq`), as a consumer does when it starts; then reports them (see
    /// [`topology`](Self::topology)). What exists already is kept; a queue declared before
    /// with other arguments is an error that names it.
    pub async fn ensure_topology(&self, topic: &str, group: &str) -> crate::Result<Report> {
        let config = |e: String| crate::Error::Config(e);
        super::wire::check_exchange(topic).map_err(config)?;
        let link = super::link::Link::open(self, "topics ensure", ANSWER_WITHIN)
            .await
            .map_err(config)?;
        let dead = format!("{topic}.dlq");
        let topology = self.topology_of(topic, group, &dead);
        let declared = topology.declare_all(&link.channel, ANSWER_WITHIN).await;
        let report = match declared {
            Ok(()) => topology.report(&link.connection).await.map_err(config),
            Err(e) => Err(config(e)),
        };
        link.close();
        report
    }

    /// Reports `topic`'s queues for consumer group `group`: each shard queue, its delay queue
    /// and the dead-letter queue, with what each holds (`None`: missing).
    pub async fn topology(&self, topic: &str, group: &str) -> crate::Result<Report> {
        let config = |e: String| crate::Error::Config(e);
        let link = super::link::Link::open(self, "status", ANSWER_WITHIN)
            .await
            .map_err(config)?;
        let dead = format!("{topic}.dlq");
        let report = self
            .topology_of(topic, group, &dead)
            .report(&link.connection)
            .await
            .map_err(config);
        link.close();
        report
    }

    fn topology_of<'a>(&'a self, topic: &'a str, group: &'a str, dead: &'a str) -> Topology<'a> {
        Topology {
            settings: self,
            topic,
            group,
            retry_suffix: ".retry",
            dead_letters: dead,
        }
    }
}

/// How long the server gets to answer an operator's request.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

impl Topology<'_> {
    /// Each queue of the topology with its depth.
    async fn report(&self, connection: &Connection) -> Result<Report, String> {
        let mut names = Vec::new();
        for shard in 0..self.settings.shards {
            names.push(self.shard_queue(shard));
            names.push(self.delay_queue(shard));
        }
        names.push(self.dead_letters.to_owned());
        let mut report = Vec::with_capacity(names.len());
        for name in names {
            let depth = depth(connection, &name, ANSWER_WITHIN).await?;
            report.push((name, depth));
        }
        Ok(report)
    }
}
