//! The broker's queues beside the database's figures, on the overview: RabbitMQ's (feature
//! `rabbitmq`), each consumer group's shard queues with what they hold.

use std::time::Duration;

use crate::admin::Status;

/// What the overview shows of the broker's queues.
pub(super) struct BrokerQueues {
    /// Which broker, where (the URL without its password), and its shape.
    pub(super) title: String,
    /// The queues, or why they could not be read.
    pub(super) rows: Result<Vec<QueueLine>, String>,
}

/// One queue, as the overview's table shows it.
pub(super) struct QueueLine {
    pub(super) topic: String,
    pub(super) group: String,
    pub(super) queue: String,
    pub(super) kind: &'static str,
    pub(super) messages: Option<u32>,
    pub(super) consumers: Option<u32>,
    /// `ok`, `missing`, or `no consumer` (a shard queue nobody reads).
    pub(super) state: &'static str,
}

/// How long the broker gets to answer, so that a page never waits longer on it.
#[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))]
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// Where the queues are read from.
#[derive(Clone, PartialEq, Debug)]
pub(super) enum Source {
    #[cfg(feature = "rabbitmq")]
    RabbitMq {
        settings: crate::rabbitmq::RabbitMq,
        groups: Vec<String>,
        /// The topics to show; empty: every topic the figures name.
        topics: Vec<String>,
    },
}

impl Source {
    /// Whether the settings can work (`Err`: why not).
    pub(super) fn check(&self) -> Result<(), String> {
        match *self {
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq {
                ref settings,
                ref groups,
                ..
            } => {
                if groups.is_empty() {
                    return Err("rabbitmq_queues needs at least one consumer group".into());
                }
                settings.check()
            }
        }
    }

    /// Reads the queues for the topics of `status` (or those given).
    #[cfg_attr(not(feature = "rabbitmq"), allow(unused_variables))]
    pub(super) async fn read(&self, status: &Status) -> BrokerQueues {
        match *self {
            #[cfg(feature = "rabbitmq")]
            Source::RabbitMq {
                ref settings,
                ref groups,
                ref topics,
            } => {
                let topics = if topics.is_empty() {
                    status.topics()
                } else {
                    topics.clone()
                };
                let read = tokio::time::timeout(ANSWER_WITHIN, settings.queues(&topics, groups));
                let rows = match read.await {
                    Ok(Ok(rows)) => Ok(rows.into_iter().map(line).collect()),
                    Ok(Err(e)) => Err(crate::error_chain(&e).to_string()),
                    Err(_) => Err(format!(
                        "RabbitMQ did not answer within {} s",
                        ANSWER_WITHIN.as_secs()
                    )),
                };
                BrokerQueues {
                    title: format!(
                        "RabbitMQ at {}, {} shards a topic",
                        settings.url_for_display(),
                        settings.shards
                    ),
                    rows,
                }
            }
        }
    }
}

#[cfg(feature = "rabbitmq")]
fn line(report: crate::rabbitmq::QueueReport) -> QueueLine {
    let state = report.state();
    QueueLine {
        kind: report.kind.label(),
        topic: report.topic,
        group: report.group,
        queue: report.queue,
        messages: report.messages,
        consumers: report.consumers,
        state,
    }
}
