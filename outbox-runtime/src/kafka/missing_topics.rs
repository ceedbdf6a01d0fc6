//! Whether the topics a consumer sends failed messages to exist: checked when it starts, and
//! every minute while one is missing. A missing one is a warning in the log, the
//! `outbox_consumer_missing_topic{topic}` gauge at 1, and a row of
//! `outbox_consumer_missing_topic` (what `outbox status` warns about), all before the first
//! message that would need it pauses the consumer (see `forward.rs`).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::producer::{FutureProducer, Producer as _};
use tokio_util::sync::CancellationToken;

use crate::inbox::shared::Shared;

/// How often the topics are looked at again while one is missing.
const AGAIN: Duration = Duration::from_secs(60);

/// How long the broker gets to answer.
const WITHIN: Duration = Duration::from_secs(10);

/// Checks until every topic exists or `cancel` fires.
pub(crate) async fn watch(
    shared: Arc<Shared>,
    producer: FutureProducer,
    cancel: CancellationToken,
) {
    let wanted = super::forward::forward_topics(&shared.settings, &shared.routes.topics());
    if wanted.is_empty() {
        return;
    }
    let group = shared.settings.group().to_owned();
    let mut reported = BTreeSet::new();
    loop {
        let producer = producer.clone();
        let asked = tokio::task::spawn_blocking(move || {
            super::metadata::existing_topics(producer.client(), WITHIN)
        })
        .await;
        match asked {
            Ok(Ok(existing)) => {
                let mut missing = Vec::new();
                for entry @ (topic, source, role) in &wanted {
                    let absent = !existing.contains_key(topic);
                    metrics::gauge!("outbox_consumer_missing_topic", "topic" => topic.clone())
                        .set(if absent { 1.0 } else { 0.0 });
                    if absent {
                        if reported.insert(topic.clone()) {
                            tracing::warn!(
                                group = %group, %topic, %source, %role,
                                "the consumer's {} topic `{topic}` (for `{source}`) does not \
                                 exist: the first message that needs it will pause every \
                                 partition until it does (`outbox topics ensure` creates it)",
                                role.replace('_', "-")
                            );
                        }
                        missing.push(entry);
                    } else if reported.remove(topic) {
                        tracing::info!(group = %group, %topic, "the consumer's topic exists now");
                    }
                }
                if let Err(e) = record(&shared, &group, &missing).await {
                    tracing::debug!(error = %crate::error_chain(&e), "cannot record the consumer's missing topics");
                }
                if missing.is_empty() {
                    return;
                }
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "cannot read the broker's topics; looking again later")
            }
            Err(e) => tracing::debug!(error = %e, "the topic check panicked"),
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(AGAIN) => {}
        }
    }
}

/// Replaces the group's rows with `missing`: a topic it no longer wants (fewer retry tiers, a
/// route removed) goes too.
async fn record(
    shared: &Shared,
    group: &str,
    missing: &[&(String, String, &'static str)],
) -> crate::Result<()> {
    let pool = match &shared.db {
        crate::inbox::database::Db::Postgres(pool) => pool,
        #[cfg(feature = "mysql")]
        crate::inbox::database::Db::MySql(pool) => {
            return crate::store::consumer_mysql::record_missing_topics(pool, group, missing).await;
        }
    };
    let topics: Vec<&str> = missing.iter().map(|(t, ..)| t.as_str()).collect();
    let sources: Vec<&str> = missing.iter().map(|(_, s, _)| s.as_str()).collect();
    let roles: Vec<&str> = missing.iter().map(|(.., r)| *r).collect();
    sqlx::query(
        "WITH gone AS ( \
             DELETE FROM outbox_consumer_missing_topic \
             WHERE group_id = $1 AND NOT topic = ANY($2)) \
         INSERT INTO outbox_consumer_missing_topic (group_id, topic, source_topic, role) \
         SELECT $1, t, s, r FROM unnest($2::text[], $3::text[], $4::text[]) AS m(t, s, r) \
         ON CONFLICT (group_id, topic) DO NOTHING",
    )
    .bind(group)
    .bind(&topics)
    .bind(&sources)
    .bind(&roles)
    .execute(pool)
    .await?;
    Ok(())
}
