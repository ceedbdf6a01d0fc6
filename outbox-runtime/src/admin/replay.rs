//! Replay: publishing stored events again, to rebuild a read projection (R-DIST-OBX-3).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chrono::{DateTime, Utc};
use sqlx::Row;

use crate::error::{Error, Result};
use crate::publish::{CloudEvents, Options, Outcome, PerKey, Transport};
use crate::store::database::{Database, Pool};
use crate::store::record::{claimed_columns, Claimed};

/// Which stored events a replay publishes: published rows of one topic, narrowed by creation
/// time (`since` inclusive, `until` exclusive), aggregate type and event type.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct ReplayFilter {
    topic: String,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    aggregate_type: Option<String>,
    event_type: Option<String>,
}

impl ReplayFilter {
    /// The published events of `topic`.
    pub fn topic(topic: impl Into<String>) -> Self {
        ReplayFilter {
            topic: topic.into(),
            since: None,
            until: None,
            aggregate_type: None,
            event_type: None,
        }
    }

    /// Events created at or after `since`.
    pub fn since(mut self, since: DateTime<Utc>) -> Self {
        self.since = Some(since);
        self
    }

    /// Events created before `until`.
    pub fn until(mut self, until: DateTime<Utc>) -> Self {
        self.until = Some(until);
        self
    }

    /// Events of this aggregate type only.
    pub fn aggregate_type(mut self, aggregate_type: impl Into<String>) -> Self {
        self.aggregate_type = Some(aggregate_type.into());
        self
    }

    /// Events of this event type only.
    pub fn event_type(mut self, event_type: impl Into<String>) -> Self {
        self.event_type = Some(event_type.into());
        self
    }

    /// The topic it replays from.
    pub fn source_topic(&self) -> &str {
        &self.topic
    }
}

/// How many events of a replay's range are published (what it sends) and not (what it skips:
/// rows waiting for the relay, or parked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ReplayCounts {
    /// From [`Replay::count`]: published events the filter selects; from [`Replay::run`]: the
    /// events it sent.
    pub published: u64,
    /// Events the filter selects that are not published (yet): never sent by a replay. With a
    /// `to_topic` they do not reach it; the relay sends them to their own topic.
    pub unpublished: u64,
}

/// `$1..$5` of the filter, without the published condition (see [`Replay::run`]).
const WHERE_SQL: &str = "\
o.topic = $1 \
AND ($2::timestamptz IS NULL OR o.created_at >= $2) \
AND ($3::timestamptz IS NULL OR o.created_at < $3) \
AND ($4::text IS NULL OR o.aggregate_type = $4) \
AND ($5::text IS NULL OR o.event_type = $5)";

/// Binds `$1..$5` of [`WHERE_SQL`] (for `query` and `query_scalar` alike).
macro_rules! bind_filter {
    ($query:expr, $filter:expr) => {
        $query
            .bind(&$filter.topic)
            .bind($filter.since)
            .bind($filter.until)
            .bind($filter.aggregate_type.as_deref())
            .bind($filter.event_type.as_deref())
    };
}

/// Publishes stored events again, from PostgreSQL or MariaDB/MySQL (the constructors take
/// either pool, as [`Relay::builder`](crate::relay::Relay::builder) does), in their original
/// order (by outbox id), with their original
/// `event_id`, key, payload and headers, so that deduplicating receivers handle each at most
/// once. Records carry the replay's time as their Kafka timestamp (so the topic's time-based
/// retention keeps them); a CloudEvent's `ce_time` stays when the event was emitted. Published
/// with the relay's idempotent producer settings, or to JetStream ([`Replay::jetstream`]),
/// where each replay gives its messages a `Nats-Msg-Id` of their own (`<event id>:replay:<ms>`):
/// with the event id alone, the stream's duplicate window would drop a replay made within it
/// (after a purge too) and acknowledge it all the same.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> outbox_runtime::Result<()> {
/// use outbox_runtime::admin::{Replay, ReplayFilter};
///
/// let replay = Replay::new(pool, "127.0.0.1:9092")?;
/// let filter = ReplayFilter::topic("order.events").event_type("OrderCreated");
/// let total = replay.count(&filter).await?.published;
/// let done = replay.run(&filter, None, |sent| eprintln!("{sent}/{total}")).await?;
/// println!("sent {}, skipped {} not yet published", done.published, done.unpublished);
/// # Ok(()) }
/// ```
pub struct Replay {
    pool: Pool,
    transport: Box<dyn Transport>,
    batch_size: i64,
    publish_timeout: Duration,
    cloud_events: Option<CloudEvents>,
}

impl std::fmt::Debug for Replay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replay")
            .field("batch_size", &self.batch_size)
            .field("publish_timeout", &self.publish_timeout)
            .finish_non_exhaustive()
    }
}

impl Replay {
    /// A replay through `transport` (the brokers' constructors: `new`,
    /// `with_producer_config`, `jetstream`).
    pub(crate) fn on(pool: impl Into<Database>, transport: Box<dyn Transport>) -> Replay {
        Replay {
            pool: pool.into().0,
            transport,
            batch_size: 1_000,
            publish_timeout: Duration::from_secs(30),
            cloud_events: None,
        }
    }

    /// Records sent before waiting for their acknowledgements (default 1,000).
    #[must_use]
    pub fn batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = i64::from(batch_size.max(1));
        self
    }

    /// Publishes as CloudEvents, as a relay with
    /// [`RelayBuilder::cloud_events`](crate::relay::RelayBuilder::cloud_events) does: give a
    /// replay the relay's setting, so its consumers read the replay too. An invalid setting
    /// (an empty source or topic list) is an error.
    pub fn cloud_events(mut self, cloud_events: CloudEvents) -> Result<Self> {
        cloud_events.check().map_err(Error::Config)?;
        self.cloud_events = Some(cloud_events);
        Ok(self)
    }

    /// How many events the filter selects, published and not (what a dry run reports).
    pub async fn count(&self, filter: &ReplayFilter) -> Result<ReplayCounts> {
        let (published, unpublished): (i64, i64) = match &self.pool {
            Pool::Postgres(pool) => {
                let sql = format!(
                    "SELECT count(*) FILTER (WHERE o.published_at IS NOT NULL), \
                            count(*) FILTER (WHERE o.published_at IS NULL) \
                     FROM outbox_event o WHERE {WHERE_SQL}"
                );
                bind_filter!(sqlx::query_as(&sql), filter)
                    .fetch_one(pool)
                    .await?
            }
            #[cfg(feature = "mysql")]
            Pool::MySql(pool) => mysql::count(pool, filter).await?,
        };
        Ok(ReplayCounts {
            published: published.max(0) as u64,
            unpublished: unpublished.max(0) as u64,
        })
    }

    /// The newest outbox row's id (0 for an empty outbox).
    async fn last_id(&self) -> Result<i64> {
        let sql = "SELECT coalesce(max(id), 0) FROM outbox_event";
        Ok(match &self.pool {
            Pool::Postgres(pool) => sqlx::query_scalar(sql).fetch_one(pool).await?,
            #[cfg(feature = "mysql")]
            Pool::MySql(pool) => sqlx::query_scalar(sql).fetch_one(pool).await?,
        })
    }

    /// The filter's rows after `after` up to `last`, at most a batch, each with whether it is
    /// published.
    async fn page(
        &self,
        filter: &ReplayFilter,
        after: i64,
        last: i64,
    ) -> Result<Vec<(Claimed, bool)>> {
        let pool = match &self.pool {
            Pool::Postgres(pool) => pool,
            #[cfg(feature = "mysql")]
            Pool::MySql(pool) => {
                return mysql::page(pool, filter, after, last, self.batch_size).await
            }
        };
        // Unpublished rows are skipped by the caller rather than in SQL: with `published_at IS
        // NOT NULL` in the query, stale statistics (a backlog just drained) make the planner
        // read the whole retention index and sort it, for every page; without it, each page is
        // a short walk of the primary key.
        let sql = format!(
            "SELECT {}, o.published_at IS NOT NULL AS published FROM outbox_event o \
             WHERE {WHERE_SQL} AND o.id > $6 AND o.id <= $8 ORDER BY o.id LIMIT $7",
            claimed_columns!()
        );
        let rows = bind_filter!(sqlx::query(&sql), filter)
            .bind(after)
            .bind(self.batch_size)
            .bind(last)
            .fetch_all(pool)
            .await?;
        rows.iter()
            .map(|row| Ok((Claimed::from_row(row, 0)?, row.try_get("published")?)))
            .collect()
    }

    /// Publishes the published events the filter selects, up to the newest row when it starts,
    /// to their topic or to `to_topic`, calling `progress` with the number sent so far after
    /// each batch. Returns how many it sent, and how many of the range it skipped because they
    /// were not published (see [`ReplayCounts::unpublished`]).
    ///
    /// Stops at the first record the broker does not acknowledge, with an error that says how
    /// far it got (events up to there were delivered; running the replay again sends them again,
    /// which deduplicating receivers ignore).
    pub async fn run(
        &self,
        filter: &ReplayFilter,
        to_topic: Option<&str>,
        mut progress: impl FnMut(u64),
    ) -> Result<ReplayCounts> {
        // Pages by `id`, after the last id seen; the range ends at the newest row now: writes
        // that go on do not extend it.
        let last = self.last_id().await?;
        let mut after = 0i64;
        let mut sent = 0u64;
        let mut unpublished = 0u64;
        loop {
            let rows = self.page(filter, after, last).await?;
            let Some((last_row, _)) = rows.last() else {
                return Ok(ReplayCounts {
                    published: sent,
                    unpublished,
                });
            };
            let now_ms = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64);
            after = last_row.id;
            let mut batch = Vec::with_capacity(rows.len());
            for (row, published) in rows {
                if published {
                    batch.push(row);
                } else {
                    unpublished += 1;
                }
            }
            for row in &mut batch {
                row.replayed_at_ms = Some(now_ms);
                if let Some(topic) = to_topic {
                    row.topic = topic.to_owned();
                }
            }
            let options = Options {
                timeout: self.publish_timeout,
                per_key: PerKey::Pipelined,
                cloud_events: self.cloud_events.as_ref(),
            };
            let outcomes = self.transport.publish(&batch, options).await;
            for (row, outcome) in batch.iter().zip(outcomes) {
                let source = match outcome {
                    Outcome::Published => {
                        sent += 1;
                        continue;
                    }
                    Outcome::Skipped => continue,
                    Outcome::Rejected(e) | Outcome::Held(e) => e,
                    Outcome::Deferred(e) => e,
                };
                return Err(Error::Replay {
                    id: row.id,
                    event_id: row.event_id,
                    sent,
                    source,
                });
            }
            progress(sent);
        }
    }
}

/// The replay's reads on MariaDB/MySQL: the same filter, `?` placeholders, and the columns
/// cast as the relay reads them there.
#[cfg(feature = "mysql")]
mod mysql {
    use sqlx::{MySql, MySqlPool, QueryBuilder, Row};

    use super::ReplayFilter;
    use crate::error::Result;
    use crate::store::record::{Claimed, MYSQL_CLAIMED_COLUMNS};

    /// Appends the filter's conditions (`WHERE` included).
    fn push_filter(sql: &mut QueryBuilder<'_, MySql>, filter: &ReplayFilter) {
        sql.push(" WHERE o.topic = ")
            .push_bind(filter.topic.clone());
        if let Some(since) = filter.since {
            sql.push(" AND o.created_at >= ")
                .push_bind(since.naive_utc());
        }
        if let Some(until) = filter.until {
            sql.push(" AND o.created_at < ")
                .push_bind(until.naive_utc());
        }
        if let Some(aggregate_type) = &filter.aggregate_type {
            sql.push(" AND o.aggregate_type = ")
                .push_bind(aggregate_type.clone());
        }
        if let Some(event_type) = &filter.event_type {
            sql.push(" AND o.event_type = ")
                .push_bind(event_type.clone());
        }
    }

    pub(super) async fn count(pool: &MySqlPool, filter: &ReplayFilter) -> Result<(i64, i64)> {
        let mut sql = QueryBuilder::new(
            "SELECT CAST(COUNT(o.published_at) AS SIGNED), \
                    CAST(COUNT(*) - COUNT(o.published_at) AS SIGNED) FROM outbox_event o",
        );
        push_filter(&mut sql, filter);
        let row = sql.build().fetch_one(pool).await?;
        Ok((row.try_get(0)?, row.try_get(1)?))
    }

    pub(super) async fn page(
        pool: &MySqlPool,
        filter: &ReplayFilter,
        after: i64,
        last: i64,
        limit: i64,
    ) -> Result<Vec<(Claimed, bool)>> {
        let mut sql = QueryBuilder::new(format!(
            "SELECT {MYSQL_CLAIMED_COLUMNS}, o.published_at IS NOT NULL FROM outbox_event o"
        ));
        push_filter(&mut sql, filter);
        sql.push(" AND o.id > ").push_bind(after);
        sql.push(" AND o.id <= ").push_bind(last);
        sql.push(" ORDER BY o.id LIMIT ").push_bind(limit);
        let rows = sql.build().fetch_all(pool).await?;
        rows.iter()
            .map(|row| {
                let published: i64 = row.try_get(11)?;
                Ok((Claimed::from_mysql_row(row)?, published != 0))
            })
            .collect()
    }
}
