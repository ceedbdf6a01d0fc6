//! `outbox topics ensure`: the topics an installation needs, created where missing.

use outbox_runtime::admin::{EnsureTopics, TopicAction, TopicRole};

use super::{chain, connect_migrated, print_json, producer_config, Result};
use crate::args::{TopicsAction, TopicsEnsureArgs};
use crate::ui;

pub async fn run(action: TopicsAction) -> Result {
    match action {
        TopicsAction::Ensure(args) => ensure(args).await,
    }
}

async fn ensure(args: TopicsEnsureArgs) -> Result {
    let TopicsEnsureArgs {
        db,
        brokers,
        topics,
        partitions,
        replication_factor,
        retry_tiers,
        retry_suffix,
        dlq_suffix,
        dry_run,
        json,
    } = args;
    let config = producer_config(&brokers)?;
    let pool = connect_migrated(&db, 2).await?;
    let mut plan = topics
        .into_iter()
        .fold(EnsureTopics::new(), EnsureTopics::topic)
        .retry_tiers(retry_tiers)
        .retry_suffix(retry_suffix)
        .dlq_suffix(dlq_suffix)
        .dry_run(dry_run);
    if let Some(p) = partitions {
        plan = plan.partitions(p);
    }
    if let Some(r) = replication_factor {
        plan = plan.replication_factor(r);
    }
    let ensured = plan.run(&pool, &config).await.map_err(chain)?;
    if json {
        return print_json(&ensured);
    }
    if ensured.is_empty() {
        out!("no topics to ensure: name some with --topic (the outbox has no waiting rows)");
        return Ok(());
    }
    let rows: Vec<Vec<String>> = ensured
        .iter()
        .map(|t| {
            vec![
                t.topic.clone(),
                match t.role {
                    TopicRole::Source => "source",
                    TopicRole::Retry => "retry",
                    TopicRole::DeadLetter => "dead-letter",
                    _ => "other",
                }
                .to_owned(),
                t.partitions.to_string(),
                match t.action {
                    TopicAction::Exists => "exists",
                    TopicAction::Created => "created",
                    TopicAction::WouldCreate => "would create",
                    _ => "other",
                }
                .to_owned(),
            ]
        })
        .collect();
    ui::table(
        &["TOPIC", "ROLE", "PARTITIONS", "ACTION"],
        &[false, false, true, false],
        &rows,
    );
    let count = |a: TopicAction| ensured.iter().filter(|t| t.action == a).count();
    if dry_run {
        out!(
            "dry run: {} of {} topics would be created",
            count(TopicAction::WouldCreate),
            ensured.len()
        );
    } else {
        out!(
            "created {} of {} topics; the others exist",
            count(TopicAction::Created),
            ensured.len()
        );
    }
    Ok(())
}
