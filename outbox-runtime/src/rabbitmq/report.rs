//! What exists of the topology and what it holds, for operators: `outbox status --rabbitmq`
//! and the console's queue table read it.

use serde::Serialize;

use super::settings::RabbitMq;

/// One queue of a topic's topology for a consumer group, and what it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QueueReport {
    /// The topic (the exchange).
    pub topic: String,
    /// The consumer group.
    pub group: String,
    /// The queue's name.
    pub queue: String,
    /// What the queue is for.
    pub kind: QueueKind,
    /// Whether the queue exists.
    pub exists: bool,
    /// Its messages ready for delivery (not those delivered and not yet acknowledged); `None`
    /// if it does not exist.
    pub messages: Option<u32>,
    /// Its consumers (on a shard queue, one of them is active); `None` if it does not exist.
    pub consumers: Option<u32>,
}

impl QueueReport {
    /// A shard queue that exists and that no consumer reads: its messages wait.
    pub fn unread(&self) -> bool {
        self.kind == QueueKind::Shard && self.consumers == Some(0)
    }

    /// A word for the queue's state, for tables: `missing`, `no consumer` (see
    /// [`unread`](Self::unread)) or `ok`.
    pub fn state(&self) -> &'static str {
        if !self.exists {
            "missing"
        } else if self.unread() {
            "no consumer"
        } else {
            "ok"
        }
    }
}

/// What a queue of the topology is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueKind {
    /// A shard's queue, which the group's consumers read.
    Shard,
    /// A shard's delay queue, where retries wait.
    Delay,
    /// The topic's dead-letter queue.
    DeadLetters,
}

impl QueueKind {
    /// A word for it, for tables.
    pub fn label(self) -> &'static str {
        match self {
            QueueKind::Shard => "shard",
            QueueKind::Delay => "delay",
            QueueKind::DeadLetters => "dead letters",
        }
    }
}

impl RabbitMq {
    /// Each of `topics`' queues for each of `groups` (shard queues, delay queues, the
    /// dead-letter queue), with what it holds; a queue that does not exist is reported as such.
    pub async fn queues(
        &self,
        topics: &[String],
        groups: &[String],
    ) -> crate::Result<Vec<QueueReport>> {
        let mut rows = Vec::new();
        for topic in topics {
            let dead_letters = format!("{topic}.dlq");
            for group in groups {
                for (queue, depth) in self.topology(topic, group).await? {
                    let kind = if queue == dead_letters {
                        QueueKind::DeadLetters
                    } else if queue.ends_with(".retry") {
                        QueueKind::Delay
                    } else {
                        QueueKind::Shard
                    };
                    rows.push(QueueReport {
                        topic: topic.clone(),
                        group: group.clone(),
                        queue,
                        kind,
                        exists: depth.is_some(),
                        messages: depth.map(|d| d.messages),
                        consumers: depth.map(|d| d.consumers),
                    });
                }
            }
        }
        Ok(rows)
    }
}
