//! Backlog figures per topic.

use std::time::Duration;

use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row};

use crate::error::Result;
pub use crate::store::inbox::InboxStatus;

/// What [`status`] reports: the outbox per topic, the inbox per topic, and the dedup ledger.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Status {
    /// Outbox figures of every topic with unpublished or parked rows, or rows published in the
    /// last minute; by topic name.
    pub outbox: Vec<TopicStatus>,
    /// Inbox figures of every topic with unprocessed or dead rows; by topic name.
    pub inbox: Vec<InboxTopicStatus>,
    /// Rows in `processed_event` (dedup mode's ledger; cut by retention): counted by
    /// [`status`] and [`health`](super::health); PostgreSQL's estimate in a running relay's
    /// checks, which must not scan a large table every 30 s.
    pub processed_event_rows: i64,
    /// Live relay instances on this database.
    pub relay_instances: i64,
    /// Live inbox processors on this database (each holds its share of the keys' shards).
    pub inbox_processors: i64,
    /// The JetStream consumers' leases (dedup mode: which instance of a group reads a topic);
    /// by group and topic.
    pub consumer_leases: Vec<ConsumerLease>,
}

impl Status {
    /// Every topic the figures name (outbox, inbox, consumer leases), each once, in that order.
    pub fn topics(&self) -> Vec<String> {
        let mut topics: Vec<String> = Vec::new();
        let outbox = self.outbox.iter().map(|t| &t.topic);
        let inbox = self.inbox.iter().map(|t| &t.topic);
        for topic in outbox
            .chain(inbox)
            .chain(self.consumer_leases.iter().map(|l| &l.topic))
        {
            if !topics.contains(topic) {
                topics.push(topic.clone());
            }
        }
        topics
    }

    /// The outbox's figures, all topics together.
    pub fn outbox_total(&self) -> RelayStatus {
        let sum = |f: fn(&TopicStatus) -> i64| self.outbox.iter().map(f).sum();
        RelayStatus {
            unpublished: sum(|t| t.unpublished),
            retrying: sum(|t| t.retrying),
            held: sum(|t| t.held),
            parked: sum(|t| t.parked),
            oldest_unpublished_age: self
                .outbox
                .iter()
                .filter_map(TopicStatus::oldest_unpublished_age)
                .max(),
        }
    }

    /// The inbox's figures, all topics together, with the dedup ledger's rows.
    pub fn inbox_total(&self) -> InboxStatus {
        let sum = |f: fn(&InboxTopicStatus) -> i64| self.inbox.iter().map(f).sum();
        InboxStatus {
            unprocessed: sum(|t| t.unprocessed),
            retrying: sum(|t| t.retrying),
            dead: sum(|t| t.dead),
            oldest_unprocessed_age: self
                .inbox
                .iter()
                .filter_map(|t| t.oldest_unprocessed_age_secs)
                .map(|s| Duration::from_secs_f64(s.max(0.0)))
                .max(),
            processed_event_rows: self.processed_event_rows,
        }
    }
}

/// A JetStream consumer group's lease on a topic: one instance reads it at a time.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct ConsumerLease {
    /// The consumer group.
    pub group: String,
    /// The topic.
    pub topic: String,
    /// Whether an instance owns it now (not released, not expired).
    pub owned: bool,
    /// Seconds until it expires unless renewed (negative: expired that long ago, its holder
    /// crashed or stalled; another instance takes it over); `None` once released.
    pub expires_in_secs: Option<f64>,
}

/// The outbox's backlog figures, all topics together: [`Relay::status`](crate::relay::Relay::status),
/// or [`Status::outbox_total`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStatus {
    /// Rows waiting to be published (not parked).
    pub unpublished: i64,
    /// Of those, rows the broker refused that wait for a retry (held ones included).
    pub retrying: i64,
    /// Of those, rows held back by an operator's problem: their topic does not exist, or the
    /// relay may not write to it. They wait until it is fixed.
    pub held: i64,
    /// Parked rows (refused `max_attempts` times; kept, skipped).
    pub parked: i64,
    /// Age of the oldest row waiting to be published.
    pub oldest_unpublished_age: Option<Duration>,
}

/// The outbox figures of one topic.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct TopicStatus {
    /// The Kafka topic these figures are about.
    pub topic: String,
    /// Rows waiting to be published (not parked).
    pub unpublished: i64,
    /// Of those, rows the broker refused that wait for a retry (held ones included).
    pub retrying: i64,
    /// Of those, rows held back by an operator's problem: the topic does not exist, or the
    /// relay may not write to it. Their keys wait until it is fixed.
    pub held: i64,
    /// Parked rows (refused too often; skipped until an operator acts).
    pub parked: i64,
    /// Age of the oldest row waiting to be published, in seconds: what to alert on.
    pub oldest_unpublished_age_secs: Option<f64>,
    /// Rows published in the last minute.
    pub published_last_minute: i64,
}

impl TopicStatus {
    /// [`oldest_unpublished_age_secs`](Self::oldest_unpublished_age_secs) as a `Duration`.
    pub fn oldest_unpublished_age(&self) -> Option<Duration> {
        self.oldest_unpublished_age_secs
            .map(|s| Duration::from_secs_f64(s.max(0.0)))
    }
}

/// The inbox figures of one topic.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct InboxTopicStatus {
    /// The topic these figures are about: the one the rows' messages were first read from.
    pub topic: String,
    /// Rows received and not processed yet (not dead).
    pub unprocessed: i64,
    /// Of those, rows that failed and wait for a retry.
    pub retrying: i64,
    /// Dead rows (failed for good; kept until an operator acts).
    pub dead: i64,
    /// Age of the oldest unprocessed row, in seconds (the processing lag).
    pub oldest_unprocessed_age_secs: Option<f64>,
}

const OUTBOX_SQL: &str = "\
SELECT topic, \
       count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL) AS unpublished, \
       count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL \
                          AND next_attempt_at IS NOT NULL) AS retrying, \
       count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL \
                          AND held_at IS NOT NULL) AS held, \
       count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked, \
       extract(epoch FROM now() - min(created_at) \
           FILTER (WHERE published_at IS NULL AND parked_at IS NULL))::float8 AS age, \
       count(*) FILTER (WHERE published_at >= now() - interval '1 minute') AS published \
FROM outbox_event \
WHERE published_at IS NULL OR published_at >= now() - interval '1 minute' \
GROUP BY topic ORDER BY topic";

const INBOX_SQL: &str = "\
SELECT topic, \
       count(*) FILTER (WHERE dead_at IS NULL) AS unprocessed, \
       count(*) FILTER (WHERE dead_at IS NULL AND next_attempt_at IS NOT NULL) AS retrying, \
       count(*) FILTER (WHERE dead_at IS NOT NULL) AS dead, \
       extract(epoch FROM now() - min(received_at) FILTER (WHERE dead_at IS NULL))::float8 AS age \
FROM inbox_event WHERE NOT processed \
GROUP BY topic ORDER BY topic";

/// The backlog figures, from the database alone. The outbox part reads only unpublished rows
/// and those of the last minute (through the partial indexes), so it stays cheap on a large
/// table; `processed_event_rows` counts that table.
pub async fn status(pool: &PgPool) -> Result<Status> {
    status_on(&mut *pool.acquire().await?, Count::Exact).await
}

/// How `processed_event`'s rows are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Count {
    /// `count(*)`: a scan of the table.
    Exact,
    /// The statistics' estimate of its live rows: free, and close enough for a periodic check.
    Estimated,
}

/// [`status`] on a connection already taken from the pool.
pub(super) async fn status_on(conn: &mut PgConnection, count: Count) -> Result<Status> {
    let outbox = sqlx::query(OUTBOX_SQL)
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(|r| {
            Ok(TopicStatus {
                topic: r.try_get("topic")?,
                unpublished: r.try_get("unpublished")?,
                retrying: r.try_get("retrying")?,
                held: r.try_get("held")?,
                parked: r.try_get("parked")?,
                oldest_unpublished_age_secs: r.try_get("age")?,
                published_last_minute: r.try_get("published")?,
            })
        })
        .collect::<Result<_>>()?;
    let inbox = sqlx::query(INBOX_SQL)
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(|r| {
            Ok(InboxTopicStatus {
                topic: r.try_get("topic")?,
                unprocessed: r.try_get("unprocessed")?,
                retrying: r.try_get("retrying")?,
                dead: r.try_get("dead")?,
                oldest_unprocessed_age_secs: r.try_get("age")?,
            })
        })
        .collect::<Result<_>>()?;
    let processed_event_rows: i64 = sqlx::query_scalar(match count {
        Count::Exact => "SELECT count(*) FROM processed_event",
        Count::Estimated => {
            // A partitioned table's rows are its partitions'.
            "SELECT coalesce(sum(n_live_tup), 0)::int8 FROM pg_stat_all_tables \
             WHERE relid = to_regclass('processed_event') \
                OR relid IN (SELECT inhrelid FROM pg_inherits \
                             WHERE inhparent = to_regclass('processed_event'))"
        }
    })
    .fetch_one(&mut *conn)
    .await?;
    let relay_instances = crate::store::relay::members(&mut *conn).await?;
    let inbox_processors =
        crate::store::shards::members(&mut *conn, crate::store::shards::Kind::Inbox).await?;
    let consumer_leases = sqlx::query(
        "SELECT group_id, topic, holder IS NOT NULL AND expires_at > now() AS owned, \
                CASE WHEN holder IS NOT NULL \
                     THEN extract(epoch FROM expires_at - now())::float8 END AS expires_in \
         FROM outbox_consumer_lease ORDER BY group_id, topic",
    )
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|r| {
        Ok(ConsumerLease {
            group: r.try_get("group_id")?,
            topic: r.try_get("topic")?,
            owned: r.try_get("owned")?,
            expires_in_secs: r.try_get("expires_in")?,
        })
    })
    .collect::<Result<_>>()?;
    Ok(Status {
        outbox,
        inbox,
        processed_event_rows,
        relay_instances,
        inbox_processors,
        consumer_leases,
    })
}
